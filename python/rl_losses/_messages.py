"""How the fake kernels' checks word their messages: as the C++ checks print them (c10's dtype names, C++'s
doubles, shapes in brackets), and the RuntimeError a failed TORCH_CHECK raises."""
from __future__ import annotations

import torch

# c10's names of the dtypes, as its messages print them.
_DTYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}


def _dt(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _num(x: float) -> str:
    # A double as a C++ ostream prints it (6 significant digits).
    return f"{x:g}"


def _shape(sizes) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def _check(cond, op: str, *parts) -> None:
    if not cond:
        raise RuntimeError(f"{op}: " + "".join(str(p) for p in parts))


def _integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
