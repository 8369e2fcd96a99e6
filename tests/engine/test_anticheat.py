"""The cheats a generated kernel tries: stale results, unwritten outputs, writing its inputs,
relying on the reference having run first."""

from __future__ import annotations

from engine_helpers import ADD_MODEL, TORCH, V, job, source

REF = ADD_MODEL


def cand(forward_body: str, extra: str = "") -> str:
    return f"""
import torch
{extra}
class ModelNew(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None
    def forward(self, a, b):
{forward_body}
"""


def test_stale_buffer_from_a_previous_call_fails(run) -> None:
    body = """        if self.cache is None:
            self.cache = a + b
        return self.cache"""
    out, _ = run(job(source(TORCH, cand(body)), source(TORCH, REF)))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT
    assert r.validation.trials_passed == 1 and r.validation.trial_count == 5


def test_unwritten_output_from_empty_fails(run) -> None:
    out, _ = run(job(source(TORCH, cand("        return torch.empty_like(a)")), source(TORCH, REF)))
    assert out.result.verdict == V.VERDICT_INCORRECT


def test_writing_the_input_cannot_change_the_reference(run) -> None:
    # Zeroes b and returns a: right only if the reference saw the modified b.
    body = "        b.zero_()\n        return a + b"
    out, _ = run(job(source(TORCH, cand(body)), source(TORCH, REF)))
    assert out.result.verdict == V.VERDICT_INCORRECT


def test_in_place_input_write_with_right_result_passes_with_a_note(run) -> None:
    body = "        a.add_(b)\n        return a"
    out, _ = run(job(source(TORCH, cand(body)), source(TORCH, REF)))
    assert out.result.verdict == V.VERDICT_OK
    assert "the kernel modified its input tensors in place" in out.result.notes


def test_candidate_runs_before_the_reference_in_some_trials(run) -> None:
    order = "import builtins\nLOG = builtins.__dict__.setdefault('_ke_order', [])\n"
    ref = REF.replace("import torch", "import torch\n" + order).replace(
        "return a + b", "LOG.append('ref')\n        return a + b"
    )
    c = cand("        LOG.append('cand')\n        return a + b", order)
    import builtins

    builtins.__dict__["_ke_order"] = []
    out, _ = run(  # no float64 run of the reference after the first trial's two
        job(source(TORCH, c), source(TORCH, ref), correct_trial_count=4, perf_trial_count=0,
            check_precision=False)
    )  # fmt: skip
    assert out.result.verdict == V.VERDICT_OK
    log = builtins.__dict__.pop("_ke_order")
    pairs = [tuple(log[i : i + 2]) for i in range(0, 8, 2)]
    assert pairs == [("cand", "ref"), ("ref", "cand"), ("cand", "ref"), ("ref", "cand")]


def test_output_reuse_hack_fails_when_the_candidate_runs_first(run) -> None:
    # Returns whatever the reference left in a module-level buffer: correct only if the
    # reference already ran on these very inputs.
    shared = "import builtins\nBOX = builtins.__dict__.setdefault('_ke_box', {})\n"
    ref = REF.replace("import torch", "import torch\n" + shared).replace(
        "return a + b", "BOX['out'] = a + b\n        return BOX['out']"
    )
    c = cand("        return BOX.get('out', torch.zeros_like(a)).clone()", shared)
    out, _ = run(job(source(TORCH, c), source(TORCH, ref)))
    assert out.result.verdict == V.VERDICT_INCORRECT


def test_speedup_over_ten_is_flagged(run) -> None:
    slow = REF.replace(
        "return a + b", "import time\n        time.sleep(0.003)\n        return a + b"
    )
    out, _ = run(
        job(
            source(TORCH, cand("        return a + b")),
            source(TORCH, slow),
            perf_trial_count=5,
            warmup_count=0,
            correct_trial_count=1,
        )
    )
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.speedup > 10
    if r.runtime.source == V.TIMING_SOURCE_CUDA_EVENTS:
        assert r.speedup_suspicious
        assert any("worth a second look" in n for n in r.notes)
    else:  # host wall-clock: noise moves it by more than 10x, no evidence (issue 41)
        assert not r.speedup_suspicious
        assert any("but not flagged (speedup_suspicious)" in n for n in r.notes), r.notes


def test_results_handed_back_in_the_timed_trials_are_caught(run) -> None:
    """Hostile: honest through the correctness trials (5 calls, fresh inputs each), then the
    last result handed back: the timed trials pass the same tensors every time. One timed
    trial runs on new inputs written in place, so the replay is INCORRECT and flagged."""
    body = """        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 5 and self.cache is not None:
            return self.cache
        self.cache = a + b
        return self.cache"""
    out, _ = run(job(source(TORCH, cand(body)), source(TORCH, REF), perf_trial_count=20))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT, r
    assert r.validation.trials_passed == r.validation.trial_count == 5  # honest until timed
    assert [f.rule_id for f in r.flags] == ["replayed_outputs"]
    assert "results computed earlier were handed back" in r.validation_error


def test_results_keyed_by_the_tensors_addresses_are_caught(run) -> None:
    """Hostile: a cache keyed by the inputs' addresses (every correctness trial has new
    tensors, so it never hits there; the timed trials reuse theirs)."""
    body = """        key = (a.data_ptr(), b.data_ptr())
        if getattr(self, "seen", None) == key:
            return self.cache
        self.seen, self.cache = key, a + b
        return self.cache"""
    out, _ = run(job(source(TORCH, cand(body)), source(TORCH, REF), perf_trial_count=20))
    assert out.result.verdict == V.VERDICT_INCORRECT, out.result
    assert [f.rule_id for f in out.result.flags] == ["replayed_outputs"]


def test_an_honest_kernel_timed_with_new_inputs_in_one_trial_stays_ok(run) -> None:
    out, _ = run(
        job(source(TORCH, cand("        return a + b")), source(TORCH, REF), perf_trial_count=20)
    )
    assert out.result.verdict == V.VERDICT_OK and not out.result.flags, out.result
