"""The search prunes by the memory ruler before it predicts time, and loses nothing by it: every
setting that fits is predicted (at the largest micro-batch of its layout and setting that fits),
and what doesn't fit is kept at its least memory, where the reasons quote it. Held against an
exhaustive walk of the same space written here from the public parts (layouts, batch_splits,
pipeline_settings, predict_layout)."""

from __future__ import annotations

import pytest

from training import strategies
from training.planner.comm import Link
from training.planner.hardware import Hardware
from training.planner.predict import predict_layout
from training.planner.ranking import closest_miss
from training.planner.search import search
from training.planner.shape import Activations, Shape
from training.planner.space import Space, Variant, batch_splits, layouts, pipeline_settings, strategy_name
from training.units import GIB

INTRA = {"all_reduce": Link(alpha_s=10e-6, busbw_gbps=450, world=8)}
INTER = {"all_reduce": Link(alpha_s=20e-6, busbw_gbps=370, world=16)}
HW = Hardware(80e9, 8, INTRA, INTER, seconds_per_sample=1e-3)
# A 7B-like model on 64 devices: its states alone overflow 20 GiB under DDP (hopeless layouts),
# fit when sharded, and its activations decide the micro-batch.
SHAPE = Shape(params=int(7e9), layers=32, block_linear_params=int(6.4e9), hidden=4096, seq_len=4096, heads=32,
              first_stage_params=int(1.3e8), last_stage_params=int(1.3e8), tp_sizes=(4096, 32))
VARIANTS = [Variant("bf16", "none", 1e-3, Activations(12 * GIB)), Variant("bf16", "full", 1.3e-3, Activations(2 * GIB)),
            Variant("fp32", "none", 2e-3, Activations(24 * GIB))]
LIMIT = 20 * GIB
SPACE = Space(world=64, devices_per_node=8, global_batch=512, replica_batch=0, variants=VARIANTS)


def key(c) -> tuple:
    return (c.strategy, c.flavour, tuple(sorted(c.dims.items())), c.precision, c.activation_checkpointing, c.sequence_parallel,
            c.micro_batch, c.pp_schedule, c.pp_virtual_stages, c.microbatches)


def exhaustive(limit: float = LIMIT) -> list[tuple[tuple, bool, float, float]]:
    """Every setting of the space, predicted: (key, fits, tokens/s of its best bucket, memory)."""
    out = []
    for flavour, d in layouts(SPACE.world, SHAPE):
        name = strategy_name(flavour, d)
        buckets = SPACE.bucket_caps_mb if strategies.get(flavour).wrapper == "ddp" and d.dp_replicate > 1 else (25.0,)
        for v in VARIANTS:
            for sp in ((False, True) if d.tp > 1 else (False,)):
                for micro, accum in batch_splits(SPACE, d.dp_size):
                    for schedule, virtual, m in pipeline_settings(SPACE, d, micro):
                        ps = [predict_layout(v.workload(SHAPE, micro, accum, m, schedule, b, True, SHAPE.seq_len, sp,
                                                        virtual), HW, flavour, d, limit, 0.0, 1e3, None, name)
                              for b in buckets]
                        if ps[0] is None:
                            continue
                        dims = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp,
                                "tp": d.tp, "ep": d.ep}
                        k = (name, flavour, tuple(sorted(dims.items())), v.precision, v.activation_checkpointing, sp, micro,
                             schedule, virtual, m)
                        out.append((k, ps[0].fits, max(p.tokens_per_s for p in ps), ps[0].memory_per_device_bytes))
    return out


@pytest.fixture(scope="module")
def both():
    return exhaustive(), search(SPACE, SHAPE, HW, SHAPE.seq_len, 1e9, LIMIT, 0.0)


def test_the_space_has_hopeless_layouts_settings_that_fit_and_settings_that_do_not(both):
    walked, _ = both
    fits = [f for _, f, _, _ in walked]
    assert 0 < sum(fits) < len(fits)
    fitting = {k[:6] for k, f, _, _ in walked if f}
    assert any(not f and k[:6] in fitting for k, f, _, _ in walked), "some layouts fit only at smaller micro-batches"
    ddp = [w for w in walked if w[0][0] == "ddp"]
    assert ddp and not any(f for _, f, _, _ in ddp), "DDP's states alone overflow the limit"
    assert any(f for k, f, _, _ in walked if k[0] == "zero3")


def test_every_setting_that_fits_at_its_largest_fitting_micro_batch_is_predicted_as_exhaustive_search_does(both):
    walked, searched = both
    largest: dict[tuple, int] = {}  # (layout, setting) -> the largest micro-batch at which anything fits
    for k, fits, _, _ in walked:
        if fits:
            largest[k[:6]] = max(largest.get(k[:6], 0), k[6])
    expected = {k: tokens for k, fits, tokens, _ in walked if fits and k[6] == largest[k[:6]]}
    got = {key(c): c.tokens_per_s for c in searched.ranked if c.fits}
    assert got == pytest.approx(expected, rel=1e-12)
    assert searched.ranked[0].tokens_per_s == max(expected.values())


def top_per_strategy(walked) -> dict[str, tuple[bool, float]]:
    """What the reasons quote of each reported strategy: its fastest fitting setting's tokens/s,
    else its least memory."""
    top: dict[str, tuple[bool, float]] = {}
    for k, fits, tokens, memory in walked:
        mine = (True, tokens) if fits else (False, -memory)
        top[k[0]] = max(top.get(k[0], mine), mine)
    return {name: (fits, v if fits else -v) for name, (fits, v) in top.items()}


def test_each_strategy_is_quoted_at_its_fastest_fit_or_else_its_least_memory(both):
    walked, searched = both
    expected = top_per_strategy(walked)
    got = {}
    for c in searched.ranked:
        got.setdefault(c.strategy, (c.fits, c.tokens_per_s if c.fits else c.memory_per_device_bytes))
    assert {k: f for k, (f, _) in got.items()} == {k: f for k, (f, _) in expected.items()}
    assert {k: v for k, (_, v) in got.items()} == pytest.approx({k: v for k, (_, v) in expected.items()}, rel=1e-12)
    assert not expected["ddp"][0] and expected["zero3"][0]
    assert searched.evaluated < len(walked), "the pruned search holds fewer settings than it walks"


def test_when_nothing_fits_the_closest_miss_is_the_least_memory_of_the_whole_space():
    limit = 1 * GIB
    walked = exhaustive(limit)
    assert not any(f for _, f, _, _ in walked)
    searched = search(SPACE, SHAPE, HW, SHAPE.seq_len, 1e9, limit, 0.0)
    least = min(memory for *_, memory in walked)
    assert min(c.memory_per_device_bytes for c in searched.ranked) == pytest.approx(least, rel=1e-12)
    assert f"needs {least / GIB:.1f} GiB per device" in closest_miss(searched.ranked, limit)
    assert {c.strategy for c in searched.ranked} == {k[0] for k, *_ in walked}, "every strategy is quoted"


def test_context_parallelism_is_searched_for_long_sequences_anywhere_and_for_small_batches_in_a_node():
    """search_cp: a model split over the sequence searches CP at any degree when a sample's least
    saved activations, over a node's TP, take a quarter of the device; inside a node with TP (cp x
    tp at most 8) when the global batch has fewer samples than devices; else not at all."""
    import dataclasses

    from training.planner.space import search_cp

    splittable = dataclasses.replace(SHAPE, context_parallel=True)
    # SHAPE's least saved activations: 2 GiB (full checkpointing), over TP 8: far below 20 GiB / 4.
    assert search_cp(SHAPE, VARIANTS, LIMIT, 8, 64, 32) == 1, "attention the CP path cannot split"
    assert search_cp(splittable, VARIANTS, LIMIT, 8, 64, 512) == 1, "512 samples keep 64 devices busy"
    assert search_cp(splittable, VARIANTS, LIMIT, 8, 64, 32) == 8
    long = [dataclasses.replace(v, activations=Activations(48 * GIB)) for v in VARIANTS]  # 6 GiB over TP 8
    assert search_cp(splittable, long, LIMIT, 8, 64, 512) == 64
    in_node = [d for _, d in layouts(64, splittable, max_cp=8) if d.cp > 1]
    assert {d.cp for d in in_node} == {2, 4, 8} and max(d.cp * d.tp for d in in_node) == 8
    assert max(d.cp for _, d in layouts(64, splittable, max_cp=64)) == 64
    assert all(d.cp == 1 for _, d in layouts(64, splittable))
