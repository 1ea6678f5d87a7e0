"""Arithmetic and unit conversion with two tools, checked against the exact answer.

A task is `a op b` (op in + - *) or `convert V unit to unit`. The model may call, one per turn
(the turn ends at TOOL_CALL_END):
    calc(EXPR)               EXPR: numbers, + - * / ( ) only; evaluated on the AST, never eval'd
    convert(VALUE, FROM, TO) units of one dimension from UNITS
and answers with a turn (ending at eos) whose last number is the answer. Reward 1 if that number
equals the answer (relative tolerance 1e-6), else 0; no answer within max_turns is 0.
"""

import ast
import operator
import random
import re

from titan_moe.rl.env import Episode, StepResult

UNITS = {  # factor to the dimension's base unit
    "length": {"mm": 1e-3, "cm": 1e-2, "m": 1.0, "km": 1e3, "in": 0.0254, "ft": 0.3048},
    "mass": {"g": 1e-3, "kg": 1.0, "lb": 0.45359237},
    "time": {"s": 1.0, "min": 60.0, "h": 3600.0},
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}
_CALL = re.compile(r"(calc|convert)\((.*?)\)", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
MAX_EXPR = 200


def safe_calc(expr: str) -> float:
    """Value of an arithmetic expression; ValueError for anything but numbers and + - * / ( )."""
    if len(expr) > MAX_EXPR:
        raise ValueError("expression too long")

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    try:
        return value(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


def convert(value: float, source: str, target: str) -> float:
    for table in UNITS.values():
        if source in table and target in table:
            return value * table[source] / table[target]
    raise ValueError(f"cannot convert {source} to {target}")


def _format(x: float) -> str:
    return f"{x:.10g}"


class ArithmeticEnv:
    def __init__(self, max_turns: int = 3, max_operand: int = 999) -> None:
        self.max_turns = max_turns
        self.max_operand = max_operand

    def reset(self, rng: random.Random) -> Episode:
        if rng.random() < 0.5:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice("+-*")
            answer = safe_calc(f"{a} {op} {b}")
            question = f"What is {a} {op} {b}?"
        else:
            table = UNITS[rng.choice(sorted(UNITS))]
            source, target = rng.sample(sorted(table), 2)
            value = rng.randint(1, 100)
            answer = convert(value, source, target)
            question = f"Convert {value} {source} to {target}."
        prompt = (f"{question} Tools: calc(EXPR), convert(VALUE, FROM, TO). "
                  "End a tool call with the tool token; end the answer with eos.\n")
        return Episode(prompt, task=answer)

    def step(self, episode: Episode, action: str) -> StepResult:
        episode.turns += 1
        call = _CALL.search(action)
        if call is not None and episode.turns < self.max_turns:
            return StepResult(done=False, observation=f"\n= {self._tool(*call.groups())}\n")
        numbers = _NUMBER.findall(action)
        if not numbers:
            return StepResult(done=True, info="no answer")
        answer = episode.task
        correct = abs(float(numbers[-1]) - answer) <= 1e-6 * max(1.0, abs(answer))
        return StepResult(done=True, reward=float(correct), success=correct)

    @staticmethod
    def _tool(name: str, args: str) -> str:
        try:
            if name == "calc":
                return _format(safe_calc(args))
            value, source, target = (a.strip() for a in args.split(","))
            return _format(convert(float(value), source, target))
        except ValueError as e:
            return f"error: {e}"
