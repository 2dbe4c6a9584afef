"""Nonuniform TP computes plain Megatron-Core's function: a property test over drawn topologies (1–3 replicas,
tp_base 1–4, any dead slots, at most 8 ranks), GPT options (layers, uneven head and query-group counts, RoPE or
learned positions, LayerNorm or RMSNorm, tied or untied embeddings, gelu/swiglu/squared_relu, vocab sizes no
width divides), DDP bucket sizes and overlap on/off, Megatron's distributed optimizer on/off with one or two
instances.

Each case runs a real multi-process NTP job and ``tests/plain_megatron.py`` — plain Megatron-Core (GPTModel, DDP,
optimizer, scheduler, MockGPTDataset as a Megatron user writes them, in a process that never imports ntp-megatron)
at TP1 with the case's data-parallel size, distributed optimizer, instance count, overlap and buckets — on the same
samples from the same initial weights (Megatron-Core's own CPU initialisation; the NTP job replays it with
``model.init: megatron``). It compares lm loss and grad norm at every iteration, all parameters and Adam moments at
the end, every TP rank's checksums of the replica state after every iteration; with two distributed-optimizer
instances, also the two holders of every optimizer shard bit for bit. Plain Megatron-Core also trains each case at
TP1 × DP1 without the distributed optimizer: its own spread between the two layouts must lie within the
tolerance too (it is printed, and logged by the fuzz script).

Not drawn: overlap with two instances and a degraded replica (refused on gloo: Megatron reduces synchronously in
the backward hooks with more than one instance, and the healthy partner's backward would wait for the degraded
rank's shadows), and ``overlap_param_gather`` (refused under NTP).

Every suite run checks the fixed examples (``tests.equivalence_cases.EXAMPLES``) and a derandomized draw
(:func:`test_ntp_computes_plain_megatron_tp1`), plus a few freshly drawn cases (:func:`test_fresh_cases`) from a
new seed per run, printed in the suite's header. ``scripts/fuzz_equivalence.sh --examples N`` runs N fresh cases
(``NTP_FUZZ_EXAMPLES``), logging each to ``NTP_FUZZ_LOG``.
"""

from __future__ import annotations

import json
import os
import time

from hypothesis import HealthCheck, Phase, assume, example, given, note, seed, settings

from tests.equivalence_cases import EXAMPLES, FRESH_SEED, ITERS, TOL, WORKED, Case, assert_twins_bitwise, cases, \
    clipped, compare_with_plain, run_plain
from tests.harness import assert_ok, assert_replicas_agree, run_job

FUZZ_EXAMPLES = int(os.environ.get("NTP_FUZZ_EXAMPLES", "0"))
FUZZ_LOG = os.environ.get("NTP_FUZZ_LOG")
SUITE_EXAMPLES = 4
FRESH_EXAMPLES = 2


def check_case(tmp_path_factory, case: Case):
    """One case: the NTP job against plain Megatron-Core at TP1 on the same samples, and every TP rank's checksums;
    returns the NTP job."""
    started = time.monotonic()
    outcome = {"case": case.to_json()}
    try:
        ntp_dir = tmp_path_factory.mktemp("ntp")
        ntp = run_job(ntp_dir, case.ntp_args(init="megatron") + ["--set", f"logging.dump_state={ntp_dir / 'state'}"])
        assert_ok(ntp)
        plain = run_plain(case, tmp_path_factory.mktemp("plain"))
        outcome["plain_spread"] = spread = plain.spread()
        assert max(spread.values()) <= TOL, f"plain Megatron-Core's own spread between layouts {spread} exceeds {TOL}"
        outcome["worst"] = compare_with_plain(case, ntp, plain)
        assert_replicas_agree(ntp, ITERS)
        if case.distributed_optimizer_instances == 2:
            assert_twins_bitwise(ntp, case)
        outcome["clipped"] = clipped(case, ntp)
        if case == WORKED:  # the suite's run covers clipping: this case's gradients are clipped every iteration
            assert outcome["clipped"], "the clipping case did not clip"
        outcome["ok"] = True
        print(f"{case}: vs plain Megatron-Core TP1 {outcome['worst']}; plain's own spread {spread}")
        return ntp
    except BaseException as exc:
        outcome["ok"] = False
        outcome["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        outcome["seconds"] = round(time.monotonic() - started, 1)
        if FUZZ_LOG:
            with open(FUZZ_LOG, "a") as log:
                log.write(json.dumps(outcome) + "\n")


def _settings():
    if FUZZ_EXAMPLES:
        return settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                        suppress_health_check=list(HealthCheck))
    return settings(max_examples=SUITE_EXAMPLES, derandomize=True, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _with_examples(test):
    for case in reversed(EXAMPLES):
        test = example(case)(test)
    return test


@_settings()
@_with_examples
@given(case=cases())
def test_ntp_computes_plain_megatron_tp1(tmp_path_factory, case: Case):
    check_case(tmp_path_factory, case)


@settings(max_examples=FRESH_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@seed(FRESH_SEED)
@given(case=cases())
def test_fresh_cases(tmp_path_factory, case: Case):
    """Cases drawn from ``FRESH_SEED``: a new seed on every suite run, printed in the suite's header
    and summary (``fresh equivalence cases: seed S``); ``NTP_EQUIVALENCE_SEED=S`` replays a run's cases. When
    one fails, hypothesis prints it (``Failing test case: test_fresh_cases(..., case=Case(tp_base=...))``):
    copy that ``Case(...)`` into ``EXAMPLES`` in ``tests/equivalence_cases.py`` with the fix, so that every
    later run checks it. (Hypothesis draws
    its simplest case first, a single TP1 rank; the derandomized draw above checks that one on every run, so it
    is skipped here.)"""
    assume(case.tp_base * case.dp > 1)
    note(f"fresh equivalence cases: seed {FRESH_SEED} (replay with NTP_EQUIVALENCE_SEED={FRESH_SEED})")
    check_case(tmp_path_factory, case)
