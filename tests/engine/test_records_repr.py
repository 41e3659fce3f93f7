"""`print(acc.switch_history)`: what a SwitchHistory says about itself (it used to show an object address)."""

from __future__ import annotations

from torch import nn

from hf_altparams.engine import PhaseSwitcher, SwitchHistory, SwitchRecord
from hf_altparams.plan import Alternating, ParamGroups


def test_empty_history_says_so() -> None:
    assert repr(SwitchHistory(window=3)) == "SwitchHistory(0 switches, window 3 (0 kept); no switch yet)"


def test_history_repr_shows_count_window_totals_and_the_last_record() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    switcher = PhaseSwitcher(
        ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]), history_window=4, release=False
    )
    for step in range(6):
        switcher.step_to(step)
    history, last = switcher.history, switcher.history.last
    assert last is not None and last.phase == "b"
    text = repr(history)
    assert " at 0x" not in text and str(history) == text
    assert text.startswith(
        f"SwitchHistory(6 switches, window 4 (4 kept), {1e3 * history.seconds:.2f} ms in all, "
        f"{history.moved_bytes:,} B moved, {history.synced_bytes:,} B synced, "
        f"{history.releases} releases; last: step 5, epoch 0, phase 'b' "
    )
    b = sum(p.numel() for p in net[1].parameters())
    # no DDP wrapper here: nothing is all-reduced (the record says 0)
    assert text.endswith(
        f"phase 'b' ({b:,} params, {last.allreduce_bytes_per_step:,} B all-reduced/step), "
        f"no DDP rebuild, {1e3 * last.seconds:.2f} ms)"
    )


def test_singular_words_and_records_without_a_position() -> None:
    history = SwitchHistory(window=1)
    history.append(SwitchRecord(None, None, "a", ("a",), 1, 4, 4, False, 0.001, released=True))
    assert repr(history) == (
        "SwitchHistory(1 switch, window 1 (1 kept), 1.00 ms in all, 0 B moved, 0 B synced, "
        "1 release; last: phase 'a' (1 params, 4 B all-reduced/step), no DDP rebuild, 1.00 ms)"
    )
