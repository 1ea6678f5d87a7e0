"""Our ops' Triton launches recorded on the CPU host instead of run, and a launch compiled for
sm_90 (Triton's own LLVM and ptxas; no GPU is needed) to read the code CUDA would run."""

import importlib
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)
_POINTER_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                  torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
                  torch.uint8: "u8", torch.bool: "i1"}


def record_launches(module_name: str, call: Callable) -> list[tuple[JITFunction, dict]]:
    """(kernel, its arguments and launch options by name) for each launch `call` makes through
    the module's `wrap_triton`; nothing runs."""
    module = importlib.import_module(module_name)
    launches = []

    def record(kernel):
        def launch(*args, **kwargs):
            # The leading arguments come positionally, the rest (constexprs, options) by name.
            launches.append((kernel, dict(zip(kernel.arg_names, args, strict=False)) | kwargs))

        return type("Grid", (), {"__getitem__": lambda self, grid: launch})()

    real = module.wrap_triton
    module.wrap_triton = record
    try:
        call(module)
    finally:
        module.wrap_triton = real
    return launches


def hopper_ptx(kernel: JITFunction, arguments: dict) -> str:
    """The launch's PTX for sm_90, with LIBDEVICE on as a CUDA launch sets it (a CPU launch
    turns it off for the interpreter)."""
    signature, constants = {}, {}
    for param in kernel.params:
        value = arguments.get(param.name)
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constants[param.name] = True if param.name == "LIBDEVICE" else value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: no Triton type for {param.name}={value!r}")
    options = {name: arguments[name] for name in ("num_warps", "num_stages") if name in arguments}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=HOPPER, options=options).asm["ptx"]
