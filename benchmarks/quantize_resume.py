"""Resume quality of quantized Adam moments (issue 23, item 3): what storing ``mu`` as
int8 and ``nu`` as int4 costs in loss after a resume, against the run-to-run noise.

    .venv/bin/python benchmarks/quantize_resume.py [--steps 300] [--k 300] [--seeds 4]

The model of ``examples/train_and_reshard.py`` (a ReLU MLP, MSE, ``optax.adam``), made
larger (256-1024-1024-1024-16, 2.4M parameters), learns a fixed random teacher network
(tanh MLP) from fresh Gaussian batches. It trains ``--steps`` steps (N), then from the
state at step N continues ``--k`` steps four ways:

* ``exact``: the state as it is (what a lossless checkpoint restores), data seed 0;
* ``lossy``: the state saved with ``jaxckpt.save(quantize={"opt/*/mu/*": "int8",
  "opt/*/nu/*": "int4"})`` and restored (``mu`` int8, ``nu`` int4), same data as ``exact``;
* ``lossy x3``: the same, quantized again at N + k/3 and N + 2k/3: three lossy resumes,
  the default ``max_lossy_resumes`` after which the manager saves the moments exactly;
* ``noise``: exact continuations whose batches after step N come from data seeds
  1..``--seeds``: how much the loss after k steps moves when only the data order does.

Everything else is deterministic (XLA on CPU gives the same numbers run to run), so
``lossy - exact`` is the quantization's own effect. The loss is measured on a fixed
held-out set of 4096 examples every 10 steps. Prints the tables and writes
``docs/images/quantize_resume.png`` (``--plot``).
"""

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import jaxckpt
from jaxckpt import _quantize as q

SIZES = [256, 1024, 1024, 1024, 16]
BATCH = 128
EVAL_EVERY = 10
RULES = q.Quantize({"opt/*/mu/*": "int8", "opt/*/nu/*": "int4"})


def init_params(key, sizes):  # as examples/train_and_reshard.py
    params = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append({"kernel": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in), "bias": jnp.zeros(n_out)})
    return params


def loss_fn(params, x, y):  # as examples/train_and_reshard.py
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["kernel"] + layer["bias"])
    out = x @ params[-1]["kernel"] + params[-1]["bias"]
    return jnp.mean((out - y) ** 2)


def teacher(x):
    """A fixed random tanh network: the function the student learns."""
    key = jax.random.key(1234)
    for i, (n_in, n_out) in enumerate(zip([SIZES[0], 256], [256, SIZES[-1]])):
        w = jax.random.normal(jax.random.fold_in(key, i), (n_in, n_out)) * (2.0 / np.sqrt(n_in))
        x = jnp.tanh(x @ w) if i == 0 else x @ w
    return x


def batch(seed, step, n=BATCH):
    x = np.random.default_rng([seed, step]).standard_normal((n, SIZES[0]), np.float32)
    return x, np.asarray(teacher(x))


def make_step(opt):
    @jax.jit
    def step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, loss

    return step


def quantize_state(state):
    """The state as a restore of a quantized checkpoint gives it back: saved with
    ``jaxckpt.save(quantize=RULES)`` into a temporary directory and restored."""
    with tempfile.TemporaryDirectory() as d:
        jaxckpt.save(os.path.join(d, "c"), state, quantize=RULES)
        return jaxckpt.restore(os.path.join(d, "c"), state)


def storage(state):
    """(stored bytes with the rules, bytes stored exactly): what a save's entries take
    (``stored_nbytes``, checksums included) with ``quantize=RULES`` and without."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        for rules in (RULES, None):
            jaxckpt.save(os.path.join(d, str(rules is None)), state, quantize=rules)
            view = jaxckpt.open(os.path.join(d, str(rules is None)))
            out.append(sum(view[p].stored_nbytes for p in view.keys() if view[p] is not None
                           and hasattr(view[p], "stored_nbytes")))
    return out[0], out[1]


def train(step, state, seed, start, k, evaluate):
    """k steps from ``start``: the eval losses every EVAL_EVERY steps and the final state."""
    curve = [(start, evaluate(state))]
    for t in range(start, start + k):
        state, _ = step(state, *batch(seed, t))
        if (t + 1 - start) % EVAL_EVERY == 0:
            curve.append((t + 1, evaluate(state)))
    return curve, state


def drift(a, b):
    """(max, mean) |a - b| over all parameters."""
    d = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                        for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"]))])
    return float(d.max()), float(d.mean())


def run_all(step, state, start, k, evaluate, seeds):
    """Every continuation from ``state`` in lockstep, so the drift against ``exact`` is
    measured at each eval without keeping snapshots."""
    third = [start + k // 3, start + 2 * k // 3]
    runs = {"exact": (0, ()), "lossy": (0, ()), "lossy x3": (0, tuple(third))}
    runs.update({f"noise seed {s}": (s, ()) for s in range(1, seeds + 1)})
    states = {name: (quantize_state(state) if name.startswith("lossy") else state) for name in runs}
    curves = {name: [(start, evaluate(s))] for name, s in states.items()}
    drifts = {name: [(start, *drift(s, states["exact"]))] for name, s in states.items() if name != "exact"}
    for t in range(start, start + k):
        for name, (seed, requantize_at) in runs.items():
            if t in requantize_at:
                states[name] = quantize_state(states[name])
            states[name], _ = step(states[name], *batch(seed, t))
        if (t + 1 - start) % EVAL_EVERY == 0:
            for name, s in states.items():
                curves[name].append((t + 1, evaluate(s)))
                if name != "exact":
                    drifts[name].append((t + 1, *drift(s, states["exact"])))
    return curves, drifts


def codec_error(state):
    """What the codec does to the trained moments themselves, and to Adam's update."""
    adam = state["opt"][0]
    mu = [np.asarray(x) for x in jax.tree.leaves(adam.mu)]
    nu = [np.asarray(x) for x in jax.tree.leaves(adam.nu)]
    count = int(adam.count)
    mu2 = [q.decode(q.encode(a, "int8"), a.shape, a.dtype, "int8") for a in mu]
    nu2 = [q.decode(q.encode(a, "int4"), a.shape, a.dtype, "int4") for a in nu]
    cat = np.concatenate
    sq, sq2 = np.sqrt(cat([a.ravel() for a in nu])), np.sqrt(cat([a.ravel() for a in nu2]))
    rel_sqrt = np.abs(sq2[sq > 0] / sq[sq > 0] - 1)

    def update(m, v):  # optax.adam's direction: bias-corrected m / (sqrt(v) + eps)
        return cat([(a / (1 - 0.9**count)).ravel() for a in m]) / (
            np.sqrt(cat([b.ravel() for b in v]) / (1 - 0.999**count)) + 1e-8)

    u = update(mu, nu)
    m_abs = cat([a.ravel() for a in mu])
    rows = {}
    for label, (m, v) in {"mu int8, nu int4": (mu2, nu2), "mu int8 only": (mu2, nu),
                          "nu int4 only": (mu, nu2)}.items():
        u2 = update(m, v)
        rows[f"update ({label}): ||u' - u|| / ||u||"] = float(np.linalg.norm(u2 - u) / np.linalg.norm(u))
        rows[f"update ({label}): max |u'| / max |u|"] = float(np.abs(u2).max() / np.abs(u).max())
    return rows | {
        "mu: max |err| / block absmax": max(_int8_err_over_absmax(a, b) for a, b in zip(mu, mu2)),
        "nu: |sqrt(v')/sqrt(v) - 1| median": float(np.median(rel_sqrt)),
        "nu: |sqrt(v')/sqrt(v) - 1| p99": float(np.quantile(rel_sqrt, 0.99)),
        "nu: |sqrt(v')/sqrt(v) - 1| max": float(rel_sqrt.max()),
        "nu: zeros among v > 0 after decode": int(((sq2 == 0) & (sq > 0)).sum()),
        "mu: ||m' - m|| / ||m||": float(np.linalg.norm(cat([a.ravel() for a in mu2]) - m_abs)
                                        / np.linalg.norm(m_abs)),
    }


def _int8_err_over_absmax(a, b):
    n = a.size
    pad = -(-n // q.BLOCK) * q.BLOCK
    blocks = np.zeros(pad, np.float32)
    blocks[:n] = a.ravel()
    err = np.zeros(pad, np.float32)
    err[:n] = np.abs(a.ravel() - b.ravel())
    absmax = np.abs(blocks.reshape(-1, q.BLOCK)).max(axis=1)
    return float((err.reshape(-1, q.BLOCK).max(axis=1) / np.where(absmax > 0, absmax, 1)).max())


def codec_speed():
    """ms to encode and to decode one 4 MiB float32 chunk, best of 5."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 1024)).astype(np.float32)
    out = {}
    for form, a in (("int8", x * 1e-3), ("int4", (x * 1e-3) ** 2)):
        p = q.encode(a, form)
        enc = min(_timed(lambda: q.encode(a, form)) for _ in range(5))
        dec = min(_timed(lambda: q.decode(p, a.shape, a.dtype, form)) for _ in range(5))
        out[form] = (enc * 1e3, dec * 1e3)
    return out


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plot(prefix, curves, drifts, path):
    fig, (ax_loss, ax_delta, ax_drift) = plt.subplots(1, 3, figsize=(16, 4.6))
    noise = [name for name in curves if name.startswith("noise")]
    steps = np.array([s for s, _ in curves["exact"]])
    exact = np.array([v for _, v in curves["exact"]])
    band = np.array([[v for _, v in curves[name]] for name in noise + ["exact"]])
    style = {"exact": ("k", "-"), "lossy": ("tab:red", "--"), "lossy x3": ("tab:orange", ":")}
    ax_loss.plot(*zip(*prefix), color="0.5", label="training to step N")
    ax_loss.fill_between(steps, band.min(0), band.max(0), color="tab:blue", alpha=0.25,
                         label=f"noise: data seeds 0-{len(noise)}")
    for name, (color, ls) in style.items():
        ax_loss.plot(steps, [v for _, v in curves[name]], color=color, ls=ls, label=name)
    ax_loss.set(yscale="log", xlabel="step", ylabel="held-out loss (MSE)", title="Loss, resumed at step N")
    ax_loss.legend(fontsize=8)
    ax_delta.fill_between(steps, band.min(0) - exact, band.max(0) - exact, color="tab:blue", alpha=0.25,
                          label="noise band - exact")
    for name in ("lossy", "lossy x3"):
        color, ls = style[name]
        ax_delta.plot(steps, np.array([v for _, v in curves[name]]) - exact, color=color, ls=ls, label=name)
    ax_delta.axhline(0, color="k", lw=0.8)
    ax_delta.set(xlabel="step", ylabel="loss - exact resume's loss", title="Difference from the exact resume")
    ax_delta.legend(fontsize=8)
    for name, rows in drifts.items():
        color, ls = style.get(name, ("tab:blue", "-"))
        alpha = 0.35 if name.startswith("noise") else 1.0
        label = name if not name.startswith("noise") or name.endswith(" 1") else None
        label = "noise seeds (data order)" if label and name.startswith("noise") else label
        ax_drift.plot([r[0] for r in rows[1:]], [r[2] for r in rows[1:]], color=color, ls=ls, alpha=alpha,
                      label=label and f"{label}: mean")
        if not name.startswith("noise"):
            ax_drift.plot([r[0] for r in rows[1:]], [r[1] for r in rows[1:]], color=color, ls=ls, lw=0.8,
                          alpha=0.5, label=f"{name}: max")
    ax_drift.set(yscale="log", xlabel="step", ylabel="|param - exact resume's param|",
                 title="Parameter drift from the exact resume")
    ax_drift.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300, help="N: steps before the resume")
    ap.add_argument("--k", type=int, default=300, help="steps after the resume")
    ap.add_argument("--seeds", type=int, default=4, help="noise runs (data seeds 1..this)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "images", "quantize_resume.png"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    opt = optax.adam(args.lr)
    params = init_params(jax.random.key(0), SIZES)
    state = {"params": params, "opt": opt.init(params)}
    step = make_step(opt)
    x_eval, y_eval = batch(10**6, 0, n=4096)
    eval_loss = jax.jit(loss_fn)

    def evaluate(s):
        return float(eval_loss(s["params"], x_eval, y_eval))

    n_params = sum(a.size for a in jax.tree.leaves(params))
    print(f"MLP {SIZES}: {n_params:,} parameters; adam lr {args.lr}; batch {BATCH}; N={args.steps}, "
          f"k={args.k}, noise seeds 1..{args.seeds}", flush=True)
    prefix, state = train(step, state, 0, 0, args.steps, evaluate)
    print(f"trained to step N={args.steps}: held-out loss {prefix[0][1]:.4f} -> {prefix[-1][1]:.4f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    report_storage(state)
    report_codec(state)
    curves, drifts = run_all(step, state, args.steps, args.k, evaluate, args.seeds)
    report_resume(curves, drifts, args)
    plot(prefix, curves, drifts, args.plot)
    print(f"\nplot: {os.path.relpath(args.plot, ROOT)}; total {time.perf_counter() - t0:.0f} s")


def report_storage(state):
    stored, exact = storage(state)
    adam = state["opt"][0]
    moments = sum(np.asarray(a).nbytes for a in jax.tree.leaves((adam.mu, adam.nu)))
    print("\n| storage (a save's entries, checksums included) | bytes | fraction of float32 |\n|---|---:|---:|")
    print(f"| whole state exact (params + mu + nu + count) | {exact:,} | 1.000 |")
    print(f"| params exact, mu int8, nu int4 | {stored:,} | {stored / exact:.3f} |")
    print(f"| mu + nu alone | {moments:,} -> {stored - (exact - moments):,} | "
          f"{(stored - (exact - moments)) / moments:.3f} |")
    print(f"| per form, whole blocks | | int8 {q.lossy_fraction('int8'):.4f}, "
          f"int4 {q.lossy_fraction('int4'):.4f} |")
    print(f"saved: {1 - stored / exact:.1%} of the Adam state (PaddleNLP reports 78.5% with int4 moments "
          f"AND the float32 master weights dropped)")


def report_codec(state):
    print("\n| codec on the trained moments at step N | value |\n|---|---:|")
    for name, value in codec_error(state).items():
        print(f"| {name} | {value:.4g} |")
    for form, (enc, dec) in codec_speed().items():
        print(f"| {form}: encode / decode a 4 MiB float32 chunk, ms | {enc:.1f} / {dec:.1f} |")


def report_resume(curves, drifts, args):
    final = {name: c[-1][1] for name, c in curves.items()}
    exact = final["exact"]
    noise = [v for name, v in final.items() if name.startswith("noise")] + [exact]
    lo, hi = min(noise), max(noise)
    # The exact resume is one draw of the band too: the lossy one is within the noise when
    # it is no further from exact than some other data order's run is.
    radius = max(abs(v - exact) for v in noise)
    print(f"\n| held-out loss at step N+k = {args.steps + args.k} | loss | vs exact | "
          f"within noise? | param drift vs exact: max / mean |\n|---|---:|---:|---|---:|")
    for name, v in final.items():
        noisy = name == "exact" or name.startswith("noise")
        inside = "-" if noisy else ("yes" if abs(v - exact) <= radius else "NO")
        d = "" if name == "exact" else f"{drifts[name][-1][1]:.2e} / {drifts[name][-1][2]:.2e}"
        print(f"| {name} | {v:.5f} | {v - exact:+.5f} | {inside} | {d} |")
    print(f"| noise band (data seeds 0..{args.seeds}) | {lo:.5f} .. {hi:.5f} | +-{radius:.5f} "
          f"(std {np.std(noise, ddof=1):.5f}) | | |")
    rel = {name: final[name] / exact - 1 for name in ("lossy", "lossy x3")}
    print(f"lossy vs exact: {rel['lossy']:+.3%}; lossy x3: {rel['lossy x3']:+.3%}; "
          f"noise band spread {(hi - lo) / exact:.3%} of the exact loss")


if __name__ == "__main__":
    main()
