"""The phase switch under DDP: 2 gloo ranks on CPU, real processes.

One launch of ``tests/scripts/engine_check.py`` runs every
scenario; the tests below read its per-rank JSON (and saved parameters). The
single-process references are computed here, in this process, with the same
``train`` function and no process group.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

pytestmark = pytest.mark.distributed

NPROC = 2


def _load_check_module() -> ModuleType:
    path = script_path("engine_check.py")
    spec = importlib.util.spec_from_file_location("hf_altparams_engine_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


check = _load_check_module()
REFERENCE_CASES = [name for name, case in check.CASES.items() if case.reference]
COUNTED_CASES = [name for name, case in check.CASES.items() if case.hook == "count"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engine_check")
    launch(script_path("engine_check.py"), str(out), nproc=NPROC, launcher="forked", timeout=300)
    return out


@pytest.fixture(scope="module")
def ranks(out_dir: Path) -> list[dict[str, Any]]:
    results = rank_results(out_dir, nproc=NPROC)
    assert all(r["world_size"] == NPROC for r in results)
    return results


def layer_bytes(groups: list[str] | tuple[str, ...], case: str = "PhaseSequence") -> int:
    """Gradient bytes of `groups` in `case`'s model, from the model's own tensors (not the engine's)."""
    spec = check.CASES[case]
    model = spec.build()
    return sum(
        p.numel() * p.element_size() for g in groups for p in model.get_submodule(spec.group_modules[g]).parameters()
    )


# ---------------------------------------------------------------- reference equivalence
@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_two_ranks_equal_single_process_reference(name: str, out_dir: Path, ranks: list[dict[str, Any]]) -> None:
    reference = check.train(check.CASES[name], distributed=False)["model"]
    for rank in range(NPROC):
        got = torch.load(out_dir / f"{name}_rank{rank}.pt")
        for param_name, param in reference.named_parameters():
            torch.testing.assert_close(
                got[param_name],
                param.detach(),
                rtol=0,
                atol=1e-6,
                msg=lambda m: f"{name}, rank {rank}, {param_name}: {m}",
            )


@pytest.mark.parametrize("name", list(check.CASES))
def test_ranks_end_bit_identical(name: str, ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["cases"][name]["params_sha256"] == ranks[1]["cases"][name]["params_sha256"]


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_groups_train_only_while_trainable(name: str, out_dir: Path, ranks: list[dict[str, Any]]) -> None:
    """Non-vacuity: each case switches, trained groups moved, never-trained groups did not."""
    steps = ranks[0]["cases"][name]["steps"]
    assert len({tuple(s["trainable"]) for s in steps}) >= 2, "the case must visit several phases"
    trained = {g for s in steps for g in s["trainable"]}
    case = check.CASES[name]
    initial = case.build()
    final = torch.load(out_dir / f"{name}_rank0.pt")
    for group, path in case.group_modules.items():
        moved = any(
            not torch.equal(final[f"{path}.{k}"], v) for k, v in initial.get_submodule(path).state_dict().items()
        )
        assert moved == (group in trained), f"{name}: group {group} trained={group in trained} moved={moved}"


# ---------------------------------------------------------------- communication
@pytest.mark.parametrize("name", COUNTED_CASES)
def test_bytes_allreduced_equal_trainable_bytes_every_step(name: str, ranks: list[dict[str, Any]]) -> None:
    case = check.CASES[name]
    schedule = case.schedule()
    for rank in ranks:
        for s in rank["cases"][name]["steps"]:
            assert s["trainable"] == sorted(schedule.phase_at(s["step"]).trainable)
            assert s["bytes_counted"] == layer_bytes(s["trainable"], name), (name, s)


@pytest.mark.parametrize("name", COUNTED_CASES)
def test_switch_record_agrees_with_counted_bytes(name: str, ranks: list[dict[str, Any]]) -> None:
    schedule = check.CASES[name].schedule()
    steps = ranks[0]["cases"][name]["steps"]
    switches = [s for s in steps if s["switch"] is not None]
    assert switches
    for s in switches:
        new_phase = sorted(schedule.phase_at(s["step"] + 1).trainable)
        assert s["switch"]["phase"] == new_phase
        assert s["switch"]["allreduce_bytes_per_step"] == layer_bytes(new_phase, name)
        assert s["switch"]["trainable_bytes"] == layer_bytes(new_phase, name)


def test_unfreezing_a_group_frozen_at_wrap_time_trains_and_syncs(ranks: list[dict[str, Any]]) -> None:
    steps = ranks[0]["cases"]["UnfreezeLater"]["steps"]
    before, after = layer_bytes(["l0", "l1", "head"]), layer_bytes(list(check.GROUP_LAYERS))
    assert [s["bytes_counted"] for s in steps] == [before] * 3 + [after] * 3
    # (trained, in sync and equal to the reference: the parametrized tests above)


def test_plain_ddp_unfreeze_diverges_documenting_the_bug(ranks: list[dict[str, Any]]) -> None:
    """Without the library, a group unfrozen after wrapping is never all-reduced: ranks drift."""
    plain = [r["plain_ddp"]["unfreeze"] for r in ranks]
    assert plain[0]["bytes_counted"] == [layer_bytes(["l0", "l1", "head"])] * 6
    assert plain[0]["group_sha256"]["l2"] != plain[1]["group_sha256"]["l2"]


def test_freezing_later_stops_allreducing_the_group(ranks: list[dict[str, Any]]) -> None:
    sent = [s["bytes_counted"] for s in ranks[0]["cases"]["ProgressiveFreeze"]["steps"]]
    per_phase = sent[::3]
    assert per_phase == sorted(per_phase, reverse=True) and len(set(per_phase)) == 4
    assert per_phase[-1] == layer_bytes(["head"])
    # A plain DDP (find_unused_parameters=True) keeps all-reducing the frozen group.
    plain = ranks[0]["plain_ddp"]["freeze"]["bytes_counted"]
    assert plain == [layer_bytes(list(check.GROUP_LAYERS))] * 6


def test_user_comm_hook_still_active_after_switches(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        steps = rank["cases"]["Fp16Hook"]["steps"]
        assert sum(s["switch"] is not None for s in steps) >= 3
        assert all(s["fp16_exact_grads"] for s in steps)  # fp16_compress_hook rounded them
        plain = rank["cases"]["Alternating"]["steps"]
        assert not all(s["fp16_exact_grads"] for s in plain)  # ... which a default DDP does not


# ---------------------------------------------------------------- memory
def test_old_gradient_buckets_are_freed_by_a_switch(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        log = rank["buckets"]
        assert all(e["switched"] for e in log)
        for e in log:
            # p.grad were views into the bucket storage (gradient_as_bucket_view=True) ...
            assert e["n_storages"] >= 1 and e["storage_bytes"] == e["grad_bytes"], e
            # ... which the reducer still held after zero_grad(set_to_none=True) ...
            assert all(e["alive_after_zero_grad"]), e
            # ... and which the switch released (gloo's worker thread may hold the last
            # all-reduced bucket a moment longer; the script waits up to 2 s, no step).
            assert all(e["expired_after_switch"]), e


def test_rss_flat_over_500_switches(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        rss = rank["rss"]
        assert rss["switches"] >= 500
        assert rss["records_kept"] == rss["window"] < rss["switches"]  # a bounded history
        growth = (rss["rss_end"] - rss["rss_warm"]) / rss["rss_warm"]
        assert growth < 0.02, f"rank {rank['rank']}: RSS grew {growth:.2%} from step {rss['warmup']} to {rss['steps']}"


# ---------------------------------------------------------------- phases that train nothing
def test_empty_phase_makes_ddp_a_pass_through(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        steps = rank["cases"]["EmptyPhase"]["steps"]
        empty = [s for s in steps if not s["trainable"]]
        assert len(empty) == 3 and all(s["bytes_counted"] == 0 for s in empty)
        into_empty = steps[1]["switch"]
        assert into_empty is not None and into_empty["allreduce_bytes_per_step"] == 0
        after = [s["bytes_counted"] for s in steps if s["trainable"] == ["head", "l0"]]
        assert after == [layer_bytes(["l0", "head"])] * 4


# ---------------------------------------------------------------- DDP settings
def test_ddp_settings_survive_rebuilds(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        for variant, kwargs in check.SETTINGS.items():
            views = rank["settings"][variant]["views"]
            assert len(views) == len(check.SETTINGS_PHASES)
            assert all(v == views[0] for v in views), (variant, views)
            first = views[0]
            assert first["find_unused_parameters"] == kwargs.get("find_unused_parameters", False)
            assert first["gradient_as_bucket_view"] == kwargs.get("gradient_as_bucket_view", False)
            assert first["static_graph"] == kwargs.get("static_graph", False)
            assert first["broadcast_buffers"] == kwargs["broadcast_buffers"]
            assert first["bucket_bytes_cap"] == int(kwargs["bucket_cap_mb"] * 1024 * 1024)
            assert first["comm_hooks"] == ["counting_allreduce_hook"]


def test_rebuilt_ddp_buckets_like_a_freshly_built_one(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        for variant in check.SETTINGS:
            data = rank["settings"][variant]
            assert data["buckets"] == data["fresh_buckets"], variant
    # The small bucket cap of variant A matters (several buckets), so the comparison is not vacuous.
    assert max(max(b) for b in ranks[0]["settings"]["A"]["buckets"]) > 1


def test_broadcast_buffers_setting_is_kept(ranks: list[dict[str, Any]]) -> None:
    markers = {v: [r["settings"][v]["marker"] for r in ranks] for v in check.SETTINGS}
    assert markers["A"] == [0.0, 1.0]  # broadcast_buffers=False: each rank keeps its own buffer
    assert markers["B"] == [0.0, 0.0]  # broadcast_buffers=True: rank 0's buffer everywhere
    for variant in check.SETTINGS:
        assert ranks[0]["settings"][variant]["params_sha256"] == ranks[1]["settings"][variant]["params_sha256"]


# ---------------------------------------------------------------- bad inputs
def _errors(ranks: list[dict[str, Any]], key: str) -> list[str]:
    outcomes = [r["bad_inputs"][key] for r in ranks]
    assert all(o["type"] == "SwitchError" for o in outcomes), outcomes
    return [o["message"] for o in outcomes]


@pytest.mark.parametrize("key", ["no_sync_all", "no_sync_rank1"])
def test_switch_inside_no_sync_refused_on_every_rank(key: str, ranks: list[dict[str, Any]]) -> None:
    messages = _errors(ranks, key)
    assert messages[0] == messages[1]
    assert "`no_sync()`" in messages[0] and "rank 1" in messages[0]


@pytest.mark.parametrize("key", ["disagree", "disagree_step"])
def test_ranks_disagreeing_on_the_phase_all_raise(key: str, ranks: list[dict[str, Any]]) -> None:
    messages = _errors(ranks, key)
    assert messages[0] == messages[1]
    assert "disagree" in messages[0]
    assert "rank 0 -> Phase(trainable=frozenset({'l" in messages[0]
    assert "rank 1 -> Phase(trainable=frozenset({'head'})" in messages[0]
    assert [r["bad_inputs"][key]["cause"] for r in ranks] == ["schedule_differs_per_rank"] * 2


@pytest.mark.parametrize("key", ["pending_all", "pending_rank1"])
def test_pending_gradients_refused_on_every_rank(key: str, ranks: list[dict[str, Any]]) -> None:
    messages = _errors(ranks, key)
    assert messages[0] == messages[1]
    assert "pending gradients" in messages[0] and "zero_grad(set_to_none=True)" in messages[0]


def test_a_trainable_parameter_without_gradient_refuses_the_switch_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    # Its bucket was never all-reduced (find_unused_parameters=False): plain DDP raises at
    # the next forward, which a switch (a new reducer) would skip; the ranks would diverge.
    messages = _errors(ranks, "unused_all")
    assert messages[0] == messages[1]
    assert "got no gradient" in messages[0] and "'heads.1.weight'" in messages[0]
    assert "find_unused_parameters=True" in messages[0]
    assert [r["bad_inputs"]["unused_all"]["cause"] for r in ranks] == ["trainable_param_unused"] * 2
    assert all(r["bad_inputs"]["unused_phase_after"] == ["l0", "t0", "t1"] for r in ranks)


def test_refused_switches_change_nothing_and_training_goes_on(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        bad = rank["bad_inputs"]
        assert bad["flags_unchanged"]
        assert bad["records_after_refusals"] == 1  # only the initial phase
        assert bad["recovered"] == {"type": None, "message": None, "cause": None}
        assert bad["steps_after_refusal"] == {"type": None, "message": None, "cause": None}
    assert ranks[0]["bad_inputs"]["params_after_refusal"] == ranks[1]["bad_inputs"]["params_after_refusal"]


def test_ddp_native_mixed_precision_refused_at_attach(ranks: list[dict[str, Any]]) -> None:
    for message in _errors(ranks, "mixed_precision"):
        assert "`mixed_precision`" in message and "autocast" in message


def test_compiled_python_reducer_detected_and_refused(ranks: list[dict[str, Any]]) -> None:
    assert all(r["bad_inputs"]["python_reducer_detected"] for r in ranks)
    for message in _errors(ranks, "python_reducer"):
        assert "python_reducer" in message


@pytest.mark.parametrize("case", ["Rollback", "KeptReducersRollback"])
def test_failed_switch_rolls_back_on_every_rank(case: str, ranks: list[dict[str, Any]]) -> None:
    schedule = check.CASES[case].schedule()
    at = check.CASES[case].fail_switch_at
    old_phase = sorted(schedule.phase_at(at - 1).trainable)
    assert sorted(schedule.phase_at(at).trainable) != old_phase
    infos = [r["cases"][case]["rollback"] for r in ranks]
    # One message on every rank, naming the rank that failed and why.
    assert infos[0]["error"] == infos[1]["error"]
    assert "rank 1: RuntimeError: injected rebuild failure" in infos[0]["error"]
    for info in infos:
        assert "restored on every rank" in info["error"]
        assert info["after"] == info["before"]  # requires_grad flags and reduced parameters
        assert info["phase_after"] == old_phase
        # The restored reducer all-reduces the old phase's gradients, and only those.
        assert info["probe_bytes"] == layer_bytes(old_phase)
        old_names = {f"{check.GROUP_LAYERS[g]}.{k}" for g in old_phase for k in ("weight", "bias")}
        assert set(info["probe_params_with_grad"]) == old_names
    # The retried switch worked and training went on (and matches the reference: see above).
    steps = ranks[0]["cases"][case]["steps"]
    assert steps[at - 1]["switch"] is not None and steps[at]["trainable"] == sorted(schedule.phase_at(at).trainable)
    assert ranks[0]["cases"][case]["records"] == 1 + sum(s["switch"] is not None for s in steps)


# ---------------------------------------------------------------- keep_reducers
KEPT_CASES = [name for name, case in check.CASES.items() if case.switcher_kwargs.get("keep_reducers")]


def _expected_cache(case: str, steps: list[dict[str, Any]]) -> tuple[int, list[tuple[str, ...]]]:
    """Re-installs and kept phases, replaying the switches on an LRU of ``keep_reducers`` entries.

    DDP's own first reducer is not kept (nothing recorded what it was built over).
    """
    size = check.CASES[case].switcher_kwargs["keep_reducers"]
    kept: list[tuple[str, ...]] = []
    live: tuple[str, ...] | None = None
    hits = 0
    for step in steps:
        if step["switch"] is None:
            continue
        phase = tuple(step["switch"]["phase"])
        if live is not None:
            kept = [p for p in kept if p != live] + [live]
        if phase in kept:
            kept.remove(phase)
            hits += 1
        kept = kept[-size:]  # the oldest past the size are freed
        live = phase
    return hits, kept


@pytest.mark.parametrize("name", [c for c in KEPT_CASES if check.CASES[c].fail_switch_at is None])
def test_kept_reducers_are_reinstalled_and_hold_the_idle_phases_buckets(name: str, ranks: list[dict[str, Any]]) -> None:
    # Parameters equal the one-process reference and bytes all-reduced equal the
    # trainable bytes every step: the generic tests above run these cases too.
    runs = [r["cases"][name] for r in ranks]
    hits, kept = _expected_cache(name, runs[0]["steps"])
    assert hits >= len(runs[0]["steps"]) // 2  # most switches went back to a kept reducer
    for run in runs:
        assert run["reducers_reused"] == hits
        assert run["kept_reducer_bytes"] == sum(layer_bytes(p, name) for p in kept)
        assert tuple(run["final_phase"]) not in kept


def test_kept_reducers_on_a_failed_switch_still_serve_later_switches(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        run = rank["cases"]["KeptReducersRollback"]
        assert run["reducers_reused"] > 0
        assert run["kept_reducer_bytes"] == layer_bytes(
            [g for g in ("l1", "head") if g not in run["final_phase"]], "KeptReducersRollback"
        )
