"""What the simulator prints and plots: result tables, the sweep, the offline bounds of a run
(``tools/sim/bounds.py``), where each run's prompt tokens went beside the KV-LRU bound's split
(``format_attribution``), the seeds-by-workload summary, and the recommended pool size."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from deltaserve.cache.loss import QUERY_CAUSES
from deltaserve.tools.sim.bounds import KvLruSplit, checkpoint_belady, kv_only_belady, kv_only_lru_split
from deltaserve.tools.sim.hybrid_bound import hybrid_lru
from deltaserve.tools.sim.simulation import GiB, MiB, SimConfig, SimResult
from deltaserve.tools.workloads import Workload, expand


@dataclass
class Bounds:
    """Offline ceilings at the run's memory (``tools/sim/bounds.py``), requests one by one
    in the submission order of the run they come from (the oracle's; with ``--bounds`` and no
    oracle, the first policy's: for open-loop arrivals, a trace's among them, that order is
    the arrival order, whatever the policy)."""

    kv_lru: float  # KV alone, LRU: what plain prefix caching of that KV memory hits
    kv_belady: float  # KV alone, clairvoyant
    checkpoint_belady: float  # checkpoints alone (KV unlimited), clairvoyant
    #: with a host tier: KV alone, LRU, over every byte of both tiers (device and host, KV and
    #: checkpoints): what plain prefix caching of the combined capacity hits (None: no host tier)
    kv_lru_host: float | None = None
    #: with a disk tier: the same over every byte of every tier, the disk's too (None: no disk)
    kv_lru_disk: float | None = None
    #: the prompt tokens of the widest KV-LRU bound computed (over every tier there is) by outcome
    kv_lru_split: KvLruSplit = field(default_factory=KvLruSplit)
    kv_lru_split_over: str = "the device KV"  # the bytes that bound has, in words
    #: asked for (``--hybrid-lru``): LRU over KV *and* exact checkpoints
    #: (``tools/sim/hybrid_bound.py``) over the same tiers' bytes (on the device: all of them,
    #: the checkpoint pool's too): what recency reaches when every hit needs its checkpoint's
    #: bytes, where a next turn extends the last one's end. A reference, not a ceiling
    hybrid_lru: float | None = None
    hybrid_lru_over: str = "the device's bytes"

    #: the ceilings as hit rates (the summary's columns)
    RATES: ClassVar[tuple[str, ...]] = (
        "kv_lru",
        "kv_belady",
        "checkpoint_belady",
        "kv_lru_host",
        "kv_lru_disk",
    )

    def rates(self) -> dict[str, float | None]:
        return {k: getattr(self, k) for k in self.RATES}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def offline_bounds(oracle: SimResult, cfg: SimConfig, *, hybrid: bool = False) -> Bounds:
    """The bounds of ``Bounds``; ``hybrid``: the hybrid LRU reference too."""
    bs = cfg.block_size
    unit = cfg.unit
    device = kv_only_lru_split(oracle.served, cfg.kv_blocks, bs)
    host = kv_only_lru_split(oracle.served, cfg.combined_kv_blocks, bs) if cfg.host_bytes else None
    disk = kv_only_lru_split(oracle.served, cfg.all_tiers_kv_blocks, bs) if cfg.disk_bytes else None
    widest, over = (
        (disk, "every tier's bytes")
        if disk is not None
        else (host, "the memory tiers' bytes")
        if host is not None
        else (device, "the device KV")
    )
    block_bytes = bs * cfg.kv_bytes_per_token
    hybrid_blocks = (
        cfg.all_tiers_kv_blocks
        if disk is not None
        else cfg.combined_kv_blocks
        if host is not None
        else cfg.device_bytes // block_bytes
    )
    return Bounds(
        kv_lru=device.hit_rate,
        kv_belady=kv_only_belady(oracle.served, cfg.kv_blocks, bs),
        checkpoint_belady=checkpoint_belady(oracle.served, cfg.checkpoint_slots, bs, unit),
        kv_lru_host=host.hit_rate if host is not None else None,
        kv_lru_disk=disk.hit_rate if disk is not None else None,
        kv_lru_split=widest,
        kv_lru_split_over=over,
        hybrid_lru=hybrid_lru(oracle.served, hybrid_blocks, bs, unit, cfg.checkpoint_bytes / block_bytes)
        if hybrid
        else None,
        hybrid_lru_over=over if host is not None or disk is not None else "the device's bytes",
    )


def summary_row(name: str, seed: int, results: Sequence[SimResult], bounds: Bounds | None) -> dict[str, Any]:
    """v1 vs default vs the ceilings, measured in the same run."""
    by = {r.policy: r.hit_rate for r in results}
    row: dict[str, Any] = {
        "workload": name,
        "seed": seed,
        **{p: by.get(p) for p in ("v1", "default", "oracle")},
    }
    row.update(bounds.rates() if bounds else dict.fromkeys(Bounds.RATES))
    default = next((r for r in results if r.policy == "default"), None)
    row["default_from_host"] = default.hit_tokens_host / max(default.prompt_tokens, 1) if default else None
    row["default_from_disk"] = default.hit_tokens_disk / max(default.prompt_tokens, 1) if default else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    d = row["default"]
    row["default/kv_lru"] = ratio(d, row["kv_lru"])
    row["default/kv_lru_host"] = ratio(d, row["kv_lru_host"])
    row["default/kv_lru_disk"] = ratio(d, row["kv_lru_disk"])
    row["default/checkpoint_belady"] = ratio(d, row["checkpoint_belady"])
    row["default/v1"] = ratio(d, row["v1"])
    row["default-v1"] = d - row["v1"] if d is not None and row["v1"] is not None else None
    row["default/oracle"] = ratio(d, row["oracle"])
    row["hybrid_lru"] = bounds.hybrid_lru if bounds else None
    row["default/hybrid_lru"] = ratio(d, row["hybrid_lru"])
    return row


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def rat(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    out = [["workload", "seed", "v1", "default", "KV LRU", "KV Belady", "ckpt Belady", "oracle",
            "def/KV-LRU", "def/ckpt", "def/v1", "def-v1", "def/oracle"]]  # fmt: skip
    for r in rows:
        out.append([
            r["workload"], str(r["seed"]), pct(r["v1"]), pct(r["default"]), pct(r["kv_lru"]),
            pct(r["kv_belady"]), pct(r["checkpoint_belady"]), pct(r["oracle"]), rat(r["default/kv_lru"]),
            rat(r["default/checkpoint_belady"]), rat(r["default/v1"]),
            "-" if r["default-v1"] is None else f"{100 * r['default-v1']:+.1f}", rat(r["default/oracle"]),
        ])  # fmt: skip
    if any(r.get("kv_lru_host") is not None for r in rows):  # a host tier: its bound too
        out[0] += ["KV LRU all tiers", "def/KV-LRU all"]
        for line, r in zip(out[1:], rows, strict=True):
            line += [pct(r.get("kv_lru_host")), rat(r.get("default/kv_lru_host"))]
    if any(r.get("kv_lru_disk") is not None for r in rows):  # a disk tier: its share and bound
        out[0] += ["def from disk", "KV LRU +disk", "def/KV-LRU +disk"]
        for line, r in zip(out[1:], rows, strict=True):
            line += [
                pct(r.get("default_from_disk")),
                pct(r.get("kv_lru_disk")),
                rat(r.get("default/kv_lru_disk")),
            ]
    if any(r.get("hybrid_lru") is not None for r in rows):  # KV + exact checkpoints, the widest bytes
        out[0] += ["hybrid LRU", "def/hybrid"]
        for line, r in zip(out[1:], rows, strict=True):
            line += [pct(r.get("hybrid_lru")), rat(r.get("default/hybrid_lru"))]
    return _grid(out)


def recommend_pool(
    sweep: dict[int, list[SimResult]], cfg: SimConfig, target: float = 0.9
) -> dict[str, int | None]:
    """Per policy: the smallest swept checkpoint pool (slots) reaching ``target`` x the oracle."""
    oracle = next((r.hit_rate for rs in sweep.values() for r in rs if r.policy == "oracle"), None)
    out: dict[str, int | None] = {}
    for slots in sorted(sweep):
        for r in sweep[slots]:
            if r.policy == "oracle":
                continue
            out.setdefault(r.policy, None)
            if out[r.policy] is None and oracle and r.hit_rate >= target * oracle:
                out[r.policy] = slots
    return out


def format_results(results: Sequence[SimResult]) -> str:
    header = ["policy", "hit rate", "vs oracle", "from host", "stored", "skipped", "ckpt evicted",
              "KV evicted", "preempt", "steps", "sim s"]  # fmt: skip
    rows = [header]
    disk = any(r.disk_bytes_written or r.hit_tokens_disk for r in results)
    if disk:
        header[4:4] = ["from disk", "disk read", "disk written", "read wait"]
    for r in results:
        rows.append([
            r.policy,
            f"{100 * r.hit_rate:.1f}%",
            "-" if r.oracle_ratio is None else f"{r.oracle_ratio:.2f}",
            f"{100 * r.hit_tokens_host / max(r.prompt_tokens, 1):.1f}%",
            str(r.checkpoints_stored),
            str(r.checkpoints_skipped_budget + r.checkpoints_skipped_pool + r.checkpoints_skipped_value),
            str(r.checkpoints_evicted),
            str(r.kv_evicted_blocks),
            str(r.preemptions),
            str(r.steps),
            f"{r.sim_time_s:.1f}",
        ])  # fmt: skip
        if disk:
            rows[-1][4:4] = [
                f"{100 * r.hit_tokens_disk / max(r.prompt_tokens, 1):.1f}%",
                f"{r.disk_bytes_read / 1e9:.1f} GB",
                f"{r.disk_bytes_written / 1e9:.1f} GB",
                f"{r.disk_read_wait_s / max(r.disk_fetches, 1):.2f} s",
            ]
    return _grid(rows)


#: the attribution table's summed columns: (header, the engine's causes, the KV-LRU bound's part
#: of ``KvLruSplit``, if it has one); with the hit they cover every prompt token looked up
ATTRIBUTION_COLUMNS: tuple[tuple[str, tuple[str, ...], str | None], ...] = (
    ("cold", ("cold",), "compulsory"),
    ("KV evicted", ("kv_evicted_device", "kv_evicted_host", "kv_evicted_disk"), "capacity"),
    ("ckpt never", ("checkpoint_never_captured",), None),
    ("ckpt skipped", ("checkpoint_skipped",), None),
    ("ckpt evicted", ("checkpoint_evicted",), None),
    ("granularity", ("granularity",), "granularity"),
    ("in flight", ("in_flight",), None),
    ("given up", ("read_budget", "disk_wait", "remote_wait"), None),
    ("logprobs", ("prompt_logprobs",), None),
)
# every query cause in exactly one column, so a row sums to 100 (a new cause must find its place)
assert sorted(c for _, cs, _ in ATTRIBUTION_COLUMNS for c in cs) == sorted(QUERY_CAUSES)
#: KV evicted by the tier it was last in: a breakdown of that column, shown with a host or disk tier
_KV_TIERS = (("dev", "kv_evicted_device"), ("host", "kv_evicted_host"), ("disk", "kv_evicted_disk"))
_ALWAYS = {"hit", "cold", "KV evicted", "granularity"}
ATTRIBUTION_LEGEND = (
    "cold: never cached (bound: compulsory); KV evicted: cached once, evicted (bound: capacity; dev/host/disk: "
    "of it, by the tier last in); ckpt never/skipped/evicted: KV there, no checkpoint",
    "granularity: the tail no hit may cover; in flight: computed by another request; given up: a disk hit "
    "dropped; preempt*: recomputed after a preemption, not in the sum; - bound: minus the bound",
)


def _attribution_row(r: SimResult) -> dict[str, float]:
    """A run's prompt tokens looked up by outcome, in % of them (the summed columns add up to 100)."""
    q, miss = r.query_tokens, r.miss_tokens
    row: dict[str, float] = {"hit": 100 * r.query_hit_tokens / q}
    for header, causes, _ in ATTRIBUTION_COLUMNS:
        row[header] = 100 * sum(miss.get(c, 0) for c in causes) / q
    for header, cause in _KV_TIERS:
        row[header] = 100 * miss.get(cause, 0) / q
    row["preempt*"] = 100 * miss.get("preemption", 0) / q
    return row


def _bound_row(split: KvLruSplit) -> dict[str, float]:
    """The bound's prompt tokens by outcome, in % of them, under the summed columns only."""
    row = {"hit": 100 * split.hit / split.prompt}
    for header, _, part in ATTRIBUTION_COLUMNS:
        row[header] = 100 * getattr(split, part) / split.prompt if part else 0.0
    return row


def _cell(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-" if not signed else ""
    if x == 0:
        return "0"
    return f"{x:{'+' if signed else ''}.{1 if abs(x) >= 1 else 2}f}"


def format_bound_ratios(results: Sequence[SimResult], bounds: Bounds) -> str:
    """Each run's hit rate as a multiple of the widest KV-LRU bound computed (over every tier
    there is; ``Bounds.kv_lru_split``), to three decimals (0.846 is not 0.85); then, on a second
    line, of the hybrid LRU (KV and exact checkpoints) over the same bytes."""

    def line(name: str, over: str, ref: float) -> str:
        runs = ", ".join(
            f"{r.policy} {100 * r.hit_rate:.1f}% = " + (f"{r.hit_rate / ref:.3f}x" if ref else "-")
            for r in results
        )
        return f"vs {name} over {over} ({100 * ref:.1f}%): {runs}"

    out = line("KV-LRU", bounds.kv_lru_split_over, bounds.kv_lru_split.hit_rate)
    if bounds.hybrid_lru is not None:
        out += "\n" + line("hybrid LRU (KV + exact checkpoints)", bounds.hybrid_lru_over, bounds.hybrid_lru)
    return out


def format_attribution(results: Sequence[SimResult], bounds: Bounds | None) -> str:
    """Where each run's prompt tokens went (% of those looked up): hit, then the misses by cause
    (``cache/loss.py``) grouped into columns that sum to 100 with the hit, ``preempt*`` apart
    (outside that sum); with ``bounds``, the KV-LRU bound's own split as a row (compulsory under
    cold, capacity under KV evicted) and under each run its difference from it, column by
    column: the gap to the bound by cause. Columns without tokens are left out; "" when no run
    looked anything up."""
    runs = [(r.policy, _attribution_row(r)) for r in results if r.query_tokens > 0]
    if not runs:
        return ""
    split = bounds.kv_lru_split if bounds is not None else None
    bound = _bound_row(split) if split is not None and split.prompt else None
    summed = ["hit"] + [header for header, _, _ in ATTRIBUTION_COLUMNS]
    tiered = any(row["host"] or row["disk"] for _, row in runs)
    headers: list[str] = []
    for h in summed:
        if h in _ALWAYS or any(row[h] for _, row in runs) or (bound is not None and bound[h]):
            headers.append(h)
        if h == "KV evicted" and tiered:
            headers += [t for t, _ in _KV_TIERS if t == "dev" or any(row[t] for _, row in runs)]
    if any(row["preempt*"] for _, row in runs):
        headers.append("preempt*")
    table = [["run", *headers]]
    if bound is not None:
        table.append(["KV-LRU bound", *(_cell(bound.get(h)) for h in headers)])
    for policy, row in runs:
        table.append([policy, *(_cell(row[h]) for h in headers)])
        if bound is not None:
            gap = [_cell(row[h] - bound[h], True) if h in bound else "" for h in headers]
            table.append(["  - bound", *gap])
    over = f"; KV-LRU bound: KV alone, LRU, over {bounds.kv_lru_split_over}" if bound and bounds else ""
    title = f"prompt tokens by outcome (% of each run's prompt tokens looked up{over}):"
    return "\n".join([title, _grid(table), *ATTRIBUTION_LEGEND])


def format_sweep(sweep: dict[int, list[SimResult]], cfg: SimConfig) -> str:
    policies = [r.policy for r in next(iter(sweep.values()))]
    rows = [["checkpoints", "memory"] + policies]
    for slots, results in sweep.items():
        by = {r.policy: r for r in results}
        rows.append(
            [str(slots), f"{slots * cfg.checkpoint_bytes / MiB:.0f} MiB"]
            + [f"{100 * by[p].hit_rate:.1f}%" for p in policies]
        )
    return _grid(rows)


def format_splits(sweep: dict[int, list[SimResult]], shared: Sequence[SimResult], cfg: SimConfig) -> str:
    """Fixed splits (KV / checkpoint MiB) of one budget, then the one budget itself."""
    policies = [r.policy for r in shared if r.policy != "oracle"]
    rows = [["KV / checkpoints"] + policies]
    for slots, results in sweep.items():
        by = {r.policy: r for r in results}
        kv = next(iter(results)).kv_mb
        rows.append(
            [f"{kv:.0f} / {slots * cfg.checkpoint_bytes / MiB:.0f} MiB"]
            + [f"{100 * by[p].hit_rate:.1f}%" if p in by else "-" for p in policies]
        )
    by = {r.policy: r for r in shared}
    rows.append(["one budget"] + [f"{100 * by[p].hit_rate:.1f}%" for p in policies])
    return _grid(rows)


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append(
            "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]).rstrip()
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def header_line(workload: Workload, cfg: SimConfig, arrival_mode: str) -> str:
    reqs = expand(workload)
    prompt = sum(len(s.prompt_ids) for s, _ in reqs)
    unit = cfg.unit
    return (
        f"workload {workload.name}: {len(reqs)} requests, {prompt} prompt tokens, {arrival_mode}; "
        f"KV {cfg.kv_blocks} blocks x {cfg.block_size} tok = {cfg.kv_bytes / MiB:.0f} MiB; "
        f"checkpoints {cfg.checkpoint_slots} x {cfg.checkpoint_bytes / MiB:.0f} MiB = "
        f"{cfg.checkpoint_pool_bytes / MiB:.0f} MiB; unit {unit} tok; interval {cfg.checkpoint_interval}"
        + (
            f"; host tier KV {cfg.host_kv_blocks * cfg.block_size * cfg.kv_bytes_per_token / MiB:.0f} MiB + "
            f"checkpoints {cfg.host_checkpoint_slots * cfg.checkpoint_bytes / MiB:.0f} MiB at {cfg.h2d_gbps:g} GB/s"
            if cfg.host_kv_blocks or cfg.host_checkpoint_slots
            else f"; host tier {cfg.host_pages} pages x {cfg.checkpoint_bytes / MiB:.0f} MiB (KV or checkpoints) "
            f"at {cfg.h2d_gbps:g} GB/s"
            if cfg.host_pages
            else ""
        )
        + (
            f"; disk tier {cfg.disk_bytes / GiB:g} GiB, read {cfg.disk_read_gbps:g} GB/s, "
            f"writes {cfg.disk_write_mbps:g} MB/s"
            if cfg.disk_bytes
            else ""
        )
    )


def plot_sweep(path: str, sweeps: dict[str, dict[int, list[SimResult]]], cfg: SimConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(sweeps)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax, (name, sweep) in zip(axes.flat, sweeps.items(), strict=False):
        budgets = list(sweep)
        mb = [s * cfg.checkpoint_bytes / MiB for s in budgets]
        policies = [r.policy for r in sweep[budgets[0]]]
        styles = itertools.cycle([("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-")])
        for p in policies:
            ys = [100 * next(r for r in sweep[b] if r.policy == p).hit_rate for b in budgets]
            if p == "oracle":
                ax.axhline(ys[0], color="black", linestyle="--", label="oracle (unlimited)")
            else:
                marker, line = next(styles)
                ax.plot(mb, ys, marker=marker, linestyle=line, alpha=0.85, label=p)
        ax.set_xscale("log")
        ax.set_xlabel(f"checkpoint memory (MiB; {cfg.checkpoint_bytes / MiB:.0f} MiB each)")
        ax.set_ylabel("prefix hit rate (%)")
        ax.set_ylim(0, 100)
        ax.set_title(f"{name} (KV {cfg.kv_bytes / MiB:.0f} MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
