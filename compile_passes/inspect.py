"""What torch.compile makes of one titan_moe block: FX graphs, Inductor code, kernels, breaks.

    python -m compile_passes.inspect --config configs/debug.toml --block mla --out /tmp/mla
    python -m compile_passes.inspect ... --passes situ_glu attn_res   # or --passes: none

The block is built from the TOML exactly as `titan_moe.plan.params` builds the model,
initialised, and run forward + backward `--steps` times under `torch.compile(fullgraph=False)`, so
graph breaks are recorded instead of raised. Our Inductor passes are the TOML's `compile.passes`
(all of them by default, as in training) unless `--passes` names others; the summary counts their
matches. The TOML's `compile.inductor` options apply too, as in training, and the summary names
them.
Every artefact comes from a hook that exists in torch 2.11 and 2.13:

    pre-grad graph    a dynamo backend that prints each captured GraphModule, then hands it to
                      Inductor's `compile_fx`
    joint graph       `inductor.config.joint_custom_pre_pass`: AOTAutograd's forward+backward
                      graph, before Inductor's joint passes and the partitioner
    post-grad graph   `inductor.config.post_grad_custom_post_pass`: each partitioned forward or
                      backward graph after every post-grad pass, i.e. exactly what is lowered
    output code       `compile_fx(inner_compile=...)`: the wrapper learns forward vs backward from
                      `is_backward` and takes the module text from the returned graph's
                      `source_code`
    kernel table      parsed from that text: definitions `name = async_compile.<backend>(...)`,
                      launches `name(` / `name.run(` in the wrapper, `extern_kernels.*` and
                      `aten.*` fallback calls; origins from the `Source Nodes / Original ATen`
                      comments (Triton) or, for C++ kernels, which carry none, by splitting the
                      descriptive name `cpp_fused_<ops>_<n>` into the post-grad graph's ATen ops
    graph breaks      `torch._dynamo.utils.counters["graph_break"]` (reason -> count)
    recompilations    `torch._dynamo.utils.guard_failures`: the failed guard behind every
                      recompile, which dynamo files per code object (the same text the
                      `recompiles` log prints, without switching torch's logging on)

The FX-graph and AOTAutograd caches are switched off for the run: a cache hit would skip the
passes and leave the graph records empty.
"""

import argparse
import json
import re
import sys
import tomllib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass

from compile_passes.inductor_settings import inductor_settings
from compile_passes.registry import PASS_NAMES, FusionPasses, check_pass_names, matched_counts
from titan_moe.model.args import ConfigError, TitanMoEArgs
from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.model.model import DecoderLayer, TitanMoE
from titan_moe.plan.params import args_from_toml

BLOCKS = ("kda", "mla", "moe", "attnres", "model")
ATTN_RES_SOURCES = 3


@dataclass
class KernelRow:
    unit: str  # "graph<i>_forward" / "graph<i>_backward"
    name: str
    kind: str  # "generated" (Inductor codegen) or "extern" (library call)
    launches: int  # per call of the unit, i.e. per forward or per backward
    origins: list[str] = field(default_factory=list)


@dataclass
class CompileInspection:
    pre_grad: list[str] = field(default_factory=list)  # one per dynamo graph, in capture order
    joint: dict[str, str] = field(default_factory=dict)  # "graph<i>" -> joint graph
    post_grad: dict[str, str] = field(default_factory=dict)  # unit -> post-grad graph
    output_code: dict[str, str] = field(default_factory=dict)  # unit -> Inductor module text
    kernels: list[KernelRow] = field(default_factory=list)
    graph_breaks: dict[str, int] = field(default_factory=dict)  # reason -> count
    recompiles: list[str] = field(default_factory=list)
    aten_ops: dict[str, set[str]] = field(default_factory=dict)  # unit -> post-grad op names
    passes: list[str] = field(default_factory=list)  # our Inductor passes installed
    inductor: dict[str, object] = field(default_factory=dict)  # compile.inductor's options
    pass_matches: dict[str, int] = field(default_factory=dict)  # pass -> matches

    @property
    def n_graph_breaks(self) -> int:
        return sum(self.graph_breaks.values())


class _Recorder:
    """Receives every hook's graph and files it under the dynamo graph being compiled."""

    def __init__(self) -> None:
        self.result = CompileInspection()
        self.graph = -1  # index of the dynamo graph currently in the backend
        self.unit = ""  # unit whose post-grad passes are running
        self.graph_of_id: dict[int, int] = {}  # Inductor graph_id -> dynamo graph index

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graph = len(self.result.pre_grad)
        self.result.pre_grad.append(gm.print_readable(print_output=False))
        return compile_fx(gm, example_inputs, inner_compile=self.inner_compile)

    def inner_compile(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
        graph_id = kwargs.get("graph_id")
        if graph_id is not None:
            # The backward of graph i may compile lazily, long after graph i left the backend.
            self.graph_of_id.setdefault(graph_id, self.graph)
        graph = self.graph_of_id.get(graph_id, self.graph)
        phase = "backward" if kwargs.get("is_backward") else "forward"
        self.unit = f"graph{graph}_{phase}"
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        source = getattr(compiled, "source_code", None)
        if source:
            self.result.output_code[self.unit] = source
        return compiled

    def on_joint(self, graph: torch.fx.Graph) -> None:
        self.result.joint[f"graph{self.graph}"] = _graph_text(graph)

    def on_post_grad(self, graph: torch.fx.Graph) -> None:
        self.result.post_grad[self.unit] = _graph_text(graph)
        self.result.aten_ops[self.unit] = _aten_op_names(graph)


class _Hook(CustomGraphPass):
    def __init__(self, fn: Callable[[torch.fx.Graph], None]) -> None:
        self.fn = fn

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fn(graph)

    def uuid(self) -> None:
        return None  # never cacheable: the hook must see every compile


def _graph_text(graph: torch.fx.Graph) -> str:
    gm = graph.owning_module
    return gm.print_readable(print_output=False) if gm is not None else str(graph)


def _aten_op_names(graph: torch.fx.Graph) -> set[str]:
    names = set()
    for node in graph.nodes:
        for op in (node.meta.get("original_aten"), node.target):
            packet = getattr(op, "_overloadpacket", None)
            if packet is not None:
                names.add(packet.__name__)
    return names


def inspect_compile(
    module: nn.Module,
    inputs: tuple,
    steps: int = 2,
    loss_fn: Callable | None = None,
    passes: Sequence[str] = (),
    inductor: Mapping[str, object] | None = None,
) -> CompileInspection:
    """Compile `module` (fullgraph=False) with our Inductor `passes` and the `inductor` options
    (`compile.inductor`'s), run forward + backward `steps` times, record it all.

    The loss is mean(out²), in fp32 or wider, unless `loss_fn(out)` is given. Later steps must
    reuse the first step's graphs, so anything they compile shows up as a recompilation.
    """
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    recorder = _Recorder()
    patches = {
        **(inductor or {}),  # the recorder's hooks and the cache switch below take precedence
        "fx_graph_cache": False,
        "joint_custom_pre_pass": _Hook(recorder.on_joint),
        "post_grad_custom_post_pass": _Hook(recorder.on_post_grad),
    }
    if passes:
        patches["joint_custom_post_pass"] = FusionPasses(passes)
    with (
        torch._inductor.config.patch(patches),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        compiled = torch.compile(module, backend=recorder.backend, fullgraph=False)
        for _ in range(steps):
            out = compiled(*inputs)
            loss = loss_fn(out) if loss_fn is not None else _mean_square(out)
            loss.backward()
    result = recorder.result
    result.passes = list(passes)
    result.inductor = dict(inductor or {})
    result.pass_matches = {name: n for name, n in matched_counts().items() if name in passes}
    result.graph_breaks = dict(counters["graph_break"])
    result.recompiles = [
        f"{code.co_name} ({code.co_filename}:{code.co_firstlineno}): {reason}"
        for code, reasons in torch._dynamo.utils.guard_failures.items()
        for reason in reasons
    ]
    for unit, source in result.output_code.items():
        result.kernels += kernel_table(unit, source, result.aten_ops.get(unit, set()))
    torch._dynamo.reset()
    return result


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.to(torch.promote_types(out.dtype, torch.float32)).square().mean()


# ---- kernel table -------------------------------------------------------------------------

_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
_ORIGIN_COMMENT = re.compile(r"Source Nodes: \[(.*?)\], Original ATen: \[(.*?)\]")
_EXTERN_CALL = re.compile(r"(?<![\w.])extern_kernels\.(\w+)\(")
_OP_CALL = re.compile(r"(?<![\w.])(?:torch\.ops\.(\w+)|(aten|prims))\.(\w+)\.(\w+)\(")
_FUSED_NAME = re.compile(r"^\w+?_fused_(\w+)_\d+$")


def kernel_table(unit: str, source: str, aten_ops: set[str]) -> list[KernelRow]:
    """Kernels of one Inductor output module, with launches per call and their FX origins."""
    lines = source.splitlines()
    wrapper: list[str] = []  # the module minus the kernels' source text
    origins: dict[str, list[str]] = {}
    i = 0
    while i < len(lines):
        match = _KERNEL_DEF.match(lines[i])
        if match is None:
            wrapper.append(lines[i])
            i += 1
            continue
        name = match.group(1)
        origins[name] = _comment_origins(lines, i) or _name_origins(name, aten_ops)
        i += 1
        # The kernel's source is a triple-quoted string whose closing quotes open a line.
        while i < len(lines) and not lines[i].lstrip().startswith(("'''", '"""')):
            i += 1
        i += 1
    text = "\n".join(wrapper)
    rows = []
    for name, origin in origins.items():
        launches = len(re.findall(rf"(?<![\w.]){re.escape(name)}(?:\.run)?\(", text))
        rows.append(KernelRow(unit, name, "generated", launches, origin))
    externs = Counter(f"extern_kernels.{m}" for m in _EXTERN_CALL.findall(text))
    for m in _OP_CALL.finditer(text):
        externs[f"{m.group(1) or m.group(2)}.{m.group(3)}.{m.group(4)}"] += 1
    for name, launches in externs.items():
        # extern_kernels.mm and friends are the ATen op of the same name.
        origin = name.replace("extern_kernels.", "aten.", 1)
        rows.append(KernelRow(unit, name, "extern", launches, [origin]))
    return rows


def _comment_origins(lines: list[str], def_line: int) -> list[str]:
    j = def_line - 1
    while j >= 0 and lines[j].startswith("#"):
        match = _ORIGIN_COMMENT.search(lines[j])
        if match:
            return [op.strip() for op in match.group(2).split(",") if op.strip()]
        j -= 1
    return []


def _name_origins(name: str, aten_ops: set[str]) -> list[str]:
    """`cpp_fused_add_mul_0` -> [aten.add, aten.mul], splitting at the graph's known op names."""
    match = _FUSED_NAME.match(name)
    if match is None:
        return []
    words = match.group(1)
    ops = sorted(aten_ops, key=len, reverse=True)
    # best[i] splits words[:i] into op names joined by "_" (None: no split found).
    best: list[list[str] | None] = [[]] + [None] * len(words)
    for end in range(1, len(words) + 1):
        for op in ops:
            start = end - len(op)
            if start < 0 or words[start:end] != op:
                continue
            prev = best[0] if start == 0 else best[start - 1]
            if start > 0 and words[start - 1] != "_":
                prev = None
            if prev is not None:
                best[end] = prev + [op]
                break
    found = best[len(words)]
    return [f"aten.{op}" for op in found] if found else []


# ---- blocks -------------------------------------------------------------------------------


def two_documents(batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[B, T] doc_ids: the first half of every row is document 0, the rest document 1."""
    row = (torch.arange(seq_len, device=device) >= seq_len // 2).long()
    return row.expand(batch, seq_len).contiguous()


def build_block(
    block: str, args: TitanMoEArgs, batch: int, seq_len: int, device: torch.device
) -> tuple[nn.Module, tuple]:
    """The initialised block and random inputs for one forward call."""
    if block not in BLOCKS:
        raise ConfigError(f"--block {block!r}: unknown block; allowed: {', '.join(BLOCKS)}")
    gen = torch.Generator().manual_seed(0)

    def hidden() -> torch.Tensor:
        x = torch.randn(batch, seq_len, args.dim, generator=gen)
        return x.to(device).requires_grad_()

    doc_ids = two_documents(batch, seq_len, device)
    std, out_std = args.init_std, args.init_std / 2**0.5  # DecoderLayer's layer-0 scaling
    if block == "model":
        with torch.device(device):
            model = TitanMoE(args)
        model.init_weights()
        tokens = torch.randint(0, args.vocab_size, (batch, seq_len), generator=gen)
        return model, (tokens.to(device), doc_ids)
    if block == "attnres":
        module: nn.Module = AttnResSite(args.dim, args.attn_res_eps)
        module.init_weights()
        return module.to(device), ([hidden() for _ in range(ATTN_RES_SOURCES)],)
    if block == "moe":
        moe_layers = [i for i in range(args.n_layers) if args.is_moe(i)]
        if not moe_layers:
            raise ConfigError("--block moe: the config has no MoE layer (n_dense_layers)")
        layer = DecoderLayer(moe_layers[0], args)
        layer.init_weights()
        return layer.ffn.to(device), (hidden(),)
    module = KimiDeltaAttention(args) if block == "kda" else GatedMLA(args)
    module.init_weights(std, out_std)
    return module.to(device), (hidden(), doc_ids)


# ---- report -------------------------------------------------------------------------------


def write_report(result: CompileInspection, out: Path, title: str) -> str:
    """Write every artefact under `out`; returns summary.md's text."""
    for sub in ("pre_grad", "joint", "post_grad", "inductor"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(result.pre_grad):
        (out / "pre_grad" / f"graph{i}.txt").write_text(text)
    for name, text in result.joint.items():
        (out / "joint" / f"{name}.txt").write_text(text)
    for unit, text in result.post_grad.items():
        (out / "post_grad" / f"{unit}.txt").write_text(text)
    for unit, text in result.output_code.items():
        (out / "inductor" / f"{unit}.py").write_text(text)
    (out / "kernels.json").write_text(
        json.dumps([asdict(k) for k in result.kernels], indent=1) + "\n"
    )
    (out / "kernels.md").write_text(_kernel_markdown(result.kernels))
    (out / "graph_breaks.md").write_text(_breaks_markdown(result))
    summary = _summary(result, title)
    (out / "summary.md").write_text(summary)
    return summary


def _kernel_markdown(kernels: list[KernelRow]) -> str:
    rows = ["| unit | kernel | kind | launches | origin ops |", "|---|---|---|---|---|"]
    rows += [
        f"| {k.unit} | `{k.name}` | {k.kind} | {k.launches} | {', '.join(k.origins) or '?'} |"
        for k in kernels
    ]
    return "\n".join(rows) + "\n"


def _breaks_markdown(result: CompileInspection) -> str:
    text = [f"# Graph breaks: {result.n_graph_breaks}", ""]
    for reason, count in result.graph_breaks.items():
        text += [f"## {count}x", "", "```", reason.strip(), "```", ""]
    text += [f"# Recompilations: {len(result.recompiles)}", ""]
    for message in result.recompiles:
        text += ["```", message.strip(), "```", ""]
    return "\n".join(text)


def _summary(result: CompileInspection, title: str) -> str:
    units = list(result.output_code)  # compile order: each forward before its backward
    generated = [k for k in result.kernels if k.kind == "generated"]
    extern = [k for k in result.kernels if k.kind == "extern"]
    lines = [
        f"# torch.compile inspection: {title}",
        "",
        f"torch {torch.__version__}",
        f"dynamo graphs: {len(result.pre_grad)}",
        f"graph breaks: {result.n_graph_breaks}",
        f"recompilations: {len(result.recompiles)}",
        f"joint graphs: {len(result.joint)}",
        f"compiled units: {len(units)} ({', '.join(units)})",
        f"generated kernels: {len(generated)} "
        f"({sum(k.launches for k in generated)} launches per forward+backward)",
        f"extern calls: {len(extern)} kinds ({sum(k.launches for k in extern)} launches)",
        "our passes: " + (", ".join(f"{name} ({n} matches)" for name, n in
                                    result.pass_matches.items()) or "none"),
        "inductor options: " + (", ".join(f"{key}={value!r}" for key, value in
                                          result.inductor.items()) or "the defaults"),
        "",
        "Files: pre_grad/, joint/, post_grad/, inductor/ (output code), kernels.md, "
        "kernels.json, graph_breaks.md.",
    ]
    for reason, count in result.graph_breaks.items():
        lines.append(f"- break ({count}x): {reason.strip().splitlines()[0]}")
    for message in result.recompiles:
        lines.append(f"- recompile: {' '.join(message.split())}")
    return "\n".join(lines) + "\n"


def _compile_strings(path: Path, key: str, default: list[str]) -> list[str]:
    """The TOML's `compile.<key>` (default when it is not set), checked to be a list of str."""
    with path.open("rb") as f:
        values = tomllib.load(f).get("compile", {}).get(key, default)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"compile.{key}: expected a list of str, got {values!r} ({path})")
    return values


def passes_from_toml(path: Path) -> list[str]:
    """The TOML's `compile.passes` (every pass when it is not set), checked."""
    return _compile_strings(path, "passes", list(PASS_NAMES))


def inductor_from_toml(path: Path) -> dict[str, object]:
    """The TOML's `compile.inductor` options (none when it is not set), checked."""
    texts = _compile_strings(path, "inductor", [])
    try:
        return inductor_settings(texts, "compile.inductor")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_passes(passes: list[str], field: str) -> None:
    try:
        check_pass_names(passes, field)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: only cpu and cuda are supported")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a training TOML file")
    parser.add_argument("--block", default="model", help=", ".join(BLOCKS))
    parser.add_argument("--seq-len", type=int, help="default: the TOML's training.seq_len")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="forward+backward passes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--passes", nargs="*", metavar="PASS",
                        help=f"our Inductor passes ({', '.join(PASS_NAMES)}); none after the flag "
                        "turns them off. Default: the TOML's compile.passes")
    opts = parser.parse_args(argv)
    try:
        args, toml_seq_len = args_from_toml(opts.config)
        passes = opts.passes if opts.passes is not None else passes_from_toml(opts.config)
        _check_passes(passes, "--passes" if opts.passes is not None else "compile.passes")
        inductor = inductor_from_toml(opts.config)
        seq_len = opts.seq_len or toml_seq_len
        device = _device(opts.device)
        module, inputs = build_block(opts.block, args, opts.batch, seq_len, device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = inspect_compile(module, inputs, steps=opts.steps, passes=passes, inductor=inductor)
    title = f"{opts.block} from {opts.config} (batch {opts.batch}, seq_len {seq_len}, {device})"
    print(write_report(result, opts.out, title), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
