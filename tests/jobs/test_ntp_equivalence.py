"""Nonuniform TP computes plain Megatron-Core's function: a property test over drawn topologies (1–3 replicas,
tp_base 1–4, any dead slots, at most 8 ranks), GPT options (layers, uneven head and query-group counts, RoPE or
learned positions, LayerNorm or RMSNorm, tied or untied embeddings, gelu/swiglu/squared_relu, vocab sizes no
width divides), DDP bucket sizes and overlap on/off. Each case runs a real multi-process NTP job and plain
Megatron-Core at TP1 on the same samples, and compares lm loss and grad norm at every iteration, all parameters
and Adam moments at the end, and every TP rank's checksums of the replica state after every iteration.

The suite runs a fixed, derandomized set (plus the explicit examples below); ``scripts/fuzz_equivalence.sh
--examples N`` runs N fresh random cases (``NTP_FUZZ_EXAMPLES``), logging each to ``NTP_FUZZ_LOG``.
"""

from __future__ import annotations

import json
import os
import time

from hypothesis import HealthCheck, Phase, example, given, settings

from tests.equivalence_cases import Case, assert_replicas_agree, cases, clipped, compare_with_reference
from tests.harness import assert_ok

FUZZ_EXAMPLES = int(os.environ.get("NTP_FUZZ_EXAMPLES", "0"))
FUZZ_LOG = os.environ.get("NTP_FUZZ_LOG")
SUITE_EXAMPLES = 6

# The design's worked example (TP4 + TP4, replica 1 lost slot 3) with overlap and small, layout-dependent
# buckets; and a case that loses two slots of one replica with an uneven head split and GQA.
WORKED = Case(tp_base=4, dp=2, dead=((1, 3),), num_layers=2, query_groups=8, heads_per_group=1, kv_channels=8,
              hidden_size=32, ffn_hidden_size=64, vocab_size=263, position="learned_absolute",
              normalization="LayerNorm", untie=False, activation="gelu", overlap=True, bucket_size=700,
              clip_grad=0.05, micro_batches=2)
UNEVEN = Case(tp_base=4, dp=2, dead=((0, 1), (0, 2)), num_layers=1, query_groups=6, heads_per_group=2,
              kv_channels=8, hidden_size=24, ffn_hidden_size=41, vocab_size=259, position="rope",
              normalization="RMSNorm", untie=True, activation="swiglu", overlap=False, bucket_size=None,
              clip_grad=1.0, micro_batches=1)
# Three replicas and blocks of unequal size: slots' buckets place the replicated parameters at different
# offsets, where a three-way sum rounds differently; their value must come from one place.
THREE_UNEVEN = Case(tp_base=2, dp=3, dead=((2, 1),), num_layers=2, query_groups=3, heads_per_group=2,
                    kv_channels=8, hidden_size=32, ffn_hidden_size=41, vocab_size=263, position="learned_absolute",
                    normalization="LayerNorm", untie=False, activation="squared_relu", overlap=True, bucket_size=3000,
                    clip_grad=1.0, micro_batches=1)


def _settings():
    if FUZZ_EXAMPLES:
        return settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                        suppress_health_check=list(HealthCheck))
    return settings(max_examples=SUITE_EXAMPLES, derandomize=True, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@_settings()
@example(WORKED)
@example(UNEVEN)
@example(THREE_UNEVEN)
@given(case=cases())
def test_ntp_computes_plain_megatron_tp1(tmp_path_factory, case: Case):
    started = time.monotonic()
    outcome = {"case": case.to_json()}
    try:
        from tests.harness import run_job

        ntp_dir = tmp_path_factory.mktemp("ntp")
        ntp = run_job(ntp_dir, case.ntp_args() + ["--set", f"logging.dump_state={ntp_dir / 'state'}"])
        assert_ok(ntp)
        ref_dir = tmp_path_factory.mktemp("tp1")
        ref = run_job(ref_dir, case.reference_args() + ["--set", f"logging.dump_state={ref_dir / 'state'}"])
        assert_ok(ref)
        outcome["worst"] = compare_with_reference(case, ntp, ref)
        assert_replicas_agree(case, ntp)
        outcome["clipped"] = clipped(case, ntp)
        if case == WORKED:  # the suite's run covers clipping: this case's gradients are clipped every iteration
            assert outcome["clipped"], "the clipping case did not clip"
        outcome["ok"] = True
    except BaseException as exc:
        outcome["ok"] = False
        outcome["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        outcome["seconds"] = round(time.monotonic() - started, 1)
        if FUZZ_LOG:
            with open(FUZZ_LOG, "a") as log:
                log.write(json.dumps(outcome) + "\n")
