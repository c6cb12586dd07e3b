"""The `deepspeed` compatibility package (compat/): what pip installs, and its refusal to go over a real
DeepSpeed, both when building and when importing."""
import glob
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT
from helpers.compat_site import install_compat

sys.path.insert(0, os.path.join(ROOT, "compat", "_backend"))
import zx_backend  # noqa: E402


def _fake_deepspeed(site_packages, version="0.16.0"):
    """The metadata a real DeepSpeed install leaves (enough for importlib.metadata to find it)."""
    info = os.path.join(site_packages, f"deepspeed-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_compat(str(tmp_path_factory.mktemp("compat")))


def _python(site, code):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, ROOT])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_installed_package_names_itself_zero_ext_and_re_exports_it(site):
    assert [os.path.basename(p) for p in glob.glob(os.path.join(site, "deepspeed-*.dist-info"))] == [
        "deepspeed-0.19.6+zeroext.0.1.0.dist-info"]
    done = _python(site, "import deepspeed, zero_ext, deepspeed.comm, deepspeed.runtime.zero.partition_parameters as pp\n"
                         "from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
                         "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save\n"
                         "from deepspeed.accelerator import get_accelerator\n"
                         "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME\n"
                         "assert deepspeed.initialize is zero_ext.initialize\n"
                         "assert deepspeed.zero.Init is zero_ext.zero.Init and pp.Init is zero_ext.zero.Init\n"
                         "assert deepspeed.DeepSpeedEngine is zero_ext.ZeroEngine\n"
                         "assert deepspeed.runtime.engine.DeepSpeedEngine is zero_ext.ZeroEngine\n"
                         "assert 'WarmupLR' in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES\n"
                         "assert get_accelerator().current_device_name() in ('cpu', 'cuda:0')\n"
                         "print(deepspeed.__version__)\n"
                         "deepspeed.tp_model_init(None, 2, None)")
    assert done.stdout.strip() == "0.19.6+zeroext.0.1.0", done.stderr
    # tensor parallelism, which zero_ext has not, is refused by name
    assert done.returncode != 0 and "not tensor parallelism" in done.stderr.splitlines()[-1]


def test_backend_reports_a_real_deepspeed_but_not_ours(tmp_path):
    real, ours = tmp_path / "real", tmp_path / "ours"
    _fake_deepspeed(str(real))
    _fake_deepspeed(str(ours), "0.19.6+zeroext.0.1.0")
    assert [v for v, _ in zx_backend.foreign_deepspeed([str(real)])] == ["0.16.0"]
    assert zx_backend.foreign_deepspeed([str(ours)]) == []


def test_pip_refuses_to_install_over_a_real_deepspeed(tmp_path):
    """A virtual environment (seeing this interpreter's packages, pip and setuptools among them) whose own
    site-packages holds a real DeepSpeed's metadata: pip's build of compat/ stops and says why."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site_packages = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    _fake_deepspeed(site_packages)
    done = install_compat(str(tmp_path / "build"), python=python, allow_overwrite=False, check=False)
    assert done.returncode != 0
    assert "DeepSpeed 0.16.0 is installed" in done.stderr + done.stdout
    assert "would replace the real one" in done.stderr + done.stdout


def test_import_refuses_files_mixed_with_a_real_deepspeed_record(site, tmp_path):
    """compat's files under a real DeepSpeed's metadata (two installs over each other): import fails."""
    site = str(shutil.copytree(site, tmp_path / "site"))
    (meta,) = glob.glob(os.path.join(site, "deepspeed-*.dist-info", "METADATA"))
    with open(meta) as f:
        text = f.read()
    with open(meta, "w") as f:
        f.write(text.replace("Version: 0.19.6+zeroext.0.1.0", "Version: 0.16.0"))
    done = _python(site, "import deepspeed")
    assert done.returncode != 0
    assert "zero_ext's compatibility layer: a real DeepSpeed and zero_ext's compat were installed" in done.stderr


@pytest.mark.parametrize("version,ours", [("0.19.6+zeroext.0.1.0", True), ("0.19.6+zero_ext", True),
                                          ("0.19.6+zero.ext", True), ("0.16.0", False), ("0.16.0+cu121", False)])
def test_version_label(version, ours):
    assert zx_backend.is_ours(version) is ours


def test_deepspeed_command_is_the_one_node_launcher(site, tmp_path):
    script = tmp_path / "show.py"
    # one write per line: the launcher runs scripts unbuffered (python -u), and both ranks share the pipe
    script.write_text("import os, sys\n"
                      "sys.stdout.write(f\"{os.environ['RANK']} {os.environ['WORLD_SIZE']} {sys.argv[1:]}\\n\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, ROOT])}
    done = subprocess.run([os.path.join(site, "bin", "deepspeed"), "--num_gpus", "2", str(script), "--x", "1"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["0 2 ['--x', '1', '--local_rank=0']",
                                                "1 2 ['--x', '1', '--local_rank=1']"]
