"""``deepspeed.ops.aio``: the async I/O op's builder (zero_ext's NVMe I/O is built in; see deepspeed.ops.op_builder)."""
from ..op_builder import AsyncIOBuilder  # noqa: F401
