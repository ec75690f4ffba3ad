"""`omnibench models list | show NAME`: the model presets, their shapes and parameter counts (no torch)."""

from __future__ import annotations

import dataclasses

import typer
from rich.table import Table

from omnibench.cli.common import console, fail


def _fmt(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="Model presets: list them, show one's architecture and size.", no_args_is_help=True)
    app.add_typer(models, name="models")

    @models.command("list")
    def list_cmd() -> None:
        """Every preset `--model` accepts, with parameter counts per module."""
        from omnibench.specs.costs import model_params
        from omnibench.specs.presets import get_model, list_models

        table = Table(title="model presets")
        for col in ("name", "llm", "vision", "audio", "params", "active"):
            table.add_column(col, justify="right" if col in ("params", "active") else "left")
        for name in list_models():
            spec = get_model(name)
            total = model_params(spec)["total"]
            active = model_params(spec, active=True)["total"]
            table.add_row(
                name,
                spec.llm.name + (" (MoE)" if spec.llm.moe else ""),
                spec.vision.name if spec.vision else "-",
                spec.audio.name if spec.audio else "-",
                _fmt(total),
                _fmt(active),
            )
        console.print(table)

    @models.command("show")
    def show_cmd(name: str = typer.Argument(..., help="Preset name, TOML/YAML model file, or Hugging Face config.json.")) -> None:
        """The resolved spec of one model and the parameters of each module."""
        from omnibench.specs.costs import llm_params, model_params
        from omnibench.specs.model import SpecError
        from omnibench.specs.presets import get_model

        try:
            spec = get_model(name)
        except SpecError as exc:
            fail(str(exc))
        params = model_params(spec)
        console.print(f"[bold]{spec.name}[/]  {_fmt(params['total'])} parameters")
        parts = [("llm", spec.llm)] + list(spec.encoders.items())
        for part, sub in parts:
            table = Table(title=f"{part}: {sub.name} ({_fmt(params[part])})", show_header=False)
            for f in dataclasses.fields(sub):
                value = getattr(sub, f.name)
                if f.name == "name":
                    continue
                table.add_row(f.name, str(value))
            if part == "llm" and spec.llm.moe is not None:
                table.add_row("active params", _fmt(llm_params(spec.llm, active=True)))
            console.print(table)
