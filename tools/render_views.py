# ruff: noqa: E402 - XLA_FLAGS must be set before jax is imported
"""Build the example checkpoints and write the HTML pages behind docs/images/view_*.png.

    python tools/render_views.py OUT_DIR [--png docs/images]

Saves a 12-layer transformer-shaped training state (params, optax adam state, step,
rng key) sharded over a ('data', 'model') mesh of 8 CPU devices, renders
``CheckpointView`` with a few subtrees open inside pages that define JupyterLab's
light and dark theme variables, and (with ``--png``) screenshots each page with
headless Chromium at 1200×900. When ``CheckpointManager`` has ``_repr_html_`` it
also renders a manager directory of 8 steps with metrics (``manager_light``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import _html

LAYERS, D_MODEL, D_MLP, VOCAB = 12, 256, 1024, 32768

# JupyterLab's theme variables (a subset of @jupyterlab/theme-light-extension and
# theme-dark-extension, variables.css), so the pages look like a notebook output.
THEMES = {
    "light": """--jp-layout-color0:white;--jp-layout-color1:white;--jp-layout-color2:#eeeeee;
      --jp-ui-font-color0:rgba(0,0,0,1);--jp-ui-font-color1:rgba(0,0,0,.87);--jp-ui-font-color2:rgba(0,0,0,.54);
      --jp-border-color1:#bdbdbd;--jp-border-color2:#e0e0e0;""",
    "dark": """--jp-layout-color0:#111111;--jp-layout-color1:#212121;--jp-layout-color2:#424242;
      --jp-ui-font-color0:rgba(255,255,255,1);--jp-ui-font-color1:rgba(255,255,255,.87);
      --jp-ui-font-color2:rgba(255,255,255,.54);--jp-border-color1:#616161;--jp-border-color2:#616161;""",
}
_COMMON = """--jp-ui-font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;
      --jp-code-font-family:Menlo,Consolas,'DejaVu Sans Mono',monospace;--jp-ui-font-size1:13px;"""

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1200,900"]


def transformer_state() -> dict:
    """Params, adam state, step and rng key of a 12-layer transformer on a 2×4 mesh."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)

    def w(shape, *spec):
        x = rng.standard_normal(shape, dtype=np.float32) * 0.02
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    def norm():
        return {"scale": w((D_MODEL,)), "bias": w((D_MODEL,))}

    layers = [{
        "attention": {"q": {"kernel": w((D_MODEL, D_MODEL), None, "model")},
                      "k": {"kernel": w((D_MODEL, D_MODEL), None, "model")},
                      "v": {"kernel": w((D_MODEL, D_MODEL), None, "model")},
                      "o": {"kernel": w((D_MODEL, D_MODEL), "model", None)}},
        "mlp": {"up": {"kernel": w((D_MODEL, D_MLP), None, "model")},
                "down": {"kernel": w((D_MLP, D_MODEL), "model", None)}},
        "norm1": norm(), "norm2": norm(),
    } for _ in range(LAYERS)]
    params = {"embed": {"embedding": w((VOCAB, D_MODEL), "model", None)}, "layers": layers,
              "final_norm": norm()}
    opt_state = optax.adam(3e-4).init(params)
    return {"params": params, "opt_state": opt_state, "step": 12000,
            "rng": jax.random.key(42), "data": {"position": np.array([12000 * 256], np.int64)}}


METADATA = {"model": "transformer-12L-d256", "optimizer": {"name": "adam", "lr": 3e-4},
            "global_batch": 256, "note": "<b>tags</b> & quotes \" are escaped"}


def page(body: str, theme: str) -> str:
    return (f"<!doctype html><html><head><meta charset=utf-8><style>:root{{{THEMES[theme]}{_COMMON}}}"
            "body{margin:16px 20px;background:var(--jp-layout-color0);color:var(--jp-ui-font-color1);"
            f"font-family:var(--jp-ui-font-family)}}</style></head><body>{body}</body></html>")


def screenshot(html_file: Path, png: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                        f"--screenshot={png.resolve()}", html_file.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)


def manager_page(out: Path) -> str | None:
    if not hasattr(jaxckpt.CheckpointManager, "_repr_html_"):
        return None
    state = {"w": jnp.arange(1024.0).reshape(32, 32), "step": 0}
    run = Path(tempfile.mkdtemp(prefix="run-", dir=out))
    with jaxckpt.CheckpointManager(run, best_metric="loss") as mgr:
        for step in range(0, 800, 100):
            mgr.save(step, {**state, "step": step},
                     metrics={"loss": 2.5 * np.exp(-step / 400) + 0.1, "accuracy": 1 - np.exp(-step / 300)})
        mgr.wait_until_finished()
        return mgr._repr_html_()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the checkpoints and HTML pages")
    parser.add_argument("--png", type=Path, help="also screenshot each page into this folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "transformer"
    jaxckpt.save(ckpt, transformer_state(), metadata=METADATA, overwrite=True)
    view = jaxckpt.open(ckpt)
    open_ = ["opt_state", "opt_state/0", "params", "params/layers", "params/layers/0",
             "params/layers/0/attention", "params/layers/0/mlp", "params/layers/0/norm1"]
    body = _html.render_view(view, expand=open_)
    pages = {f"view_{theme}": page(body, theme) for theme in THEMES}
    if (manager := manager_page(args.out)) is not None:
        pages["manager_light"] = page(manager, "light")
    else:
        print("CheckpointManager has no _repr_html_ yet: manager page skipped", file=sys.stderr)
    for name, text in pages.items():
        html_file = args.out / f"{name}.html"
        html_file.write_text(text)
        print(html_file)
        if args.png:
            args.png.mkdir(parents=True, exist_ok=True)
            screenshot(html_file, args.png / f"{name}.png")
            print(args.png / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
