"""The benchmark's table: one markdown section per part that ran, from the JSON the parts returned (so a run's
table can be written again from its JSON alone)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ntp_megatron.bench import slow_rank


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def step_time_lines(result: dict) -> list[str]:
    lines = ["| case | ranks | median step (ms) |", "|---|---|---|"]
    lines += [f"| {name} | {c['ranks']} | {c['median_step_ms']:.1f} |" for name, c in result["cases"].items()]
    lines += ["", "| comparison | ratio | note |", "|---|---|---|"]
    lines += [f"| {r['comparison']} | {r['ratio']:.3f} | {r['note']} |" for r in result["ratios"]]
    return lines


def _calls(stats: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats.get("calls", {}).items())


def _payload(stats: dict) -> int:
    return sum(stats.get("bytes", {}).values())


def communication_lines(comm: dict) -> list[str]:
    tp = comm["tp"]
    lines = ["", f"Per iteration, replica 0 (healthy) of TP{tp} x 2, without and with replica 1 degraded to "
             f"TP{tp - 1}:", "",
             "| rank | collectives (none degraded) | collectives (one degraded) | payload bytes (none) | "
             "payload bytes (one) | equal |", "|---|---|---|---|---|---|"]
    for r in comm["ranks"]:
        a, b = r["per_iteration"]["no degraded replica"], r["per_iteration"]["one degraded replica"] or {}
        lines.append(f"| replica 0, TP rank {r['tp_rank']} | {_calls(a)} | {_calls(b)} | {_payload(a)} | "
                     f"{_payload(b)} | {'yes' if r['equal'] else 'NO'} |")
    return lines


def failure_lines(failures: dict) -> list[str]:
    ntp, restart = failures["median"]["ntp"], failures["median"]["restart from checkpoint"]
    return ["", f"A failure, same job ({failures['job']}), medians:", "",
            "| | NTP | restart from checkpoint | ratio |", "|---|---|---|---|",
            f"| kill to the next completed iteration (s) | {ntp['kill_to_next_iteration_s']:.2f} | "
            f"{restart['kill_to_next_iteration_s']:.2f} | {failures['ratio_kill_to_next_iteration']:.3f} |",
            f"| kill to completing the interrupted iteration (s) | {ntp['kill_to_progress_s']:.2f} | "
            f"{restart['kill_to_progress_s']:.2f} | {failures['ratio_kill_to_progress']:.3f} |",
            f"| iterations lost: computed again (of them, completed ones rolled back) | "
            f"{ntp['iterations_lost']:g} ({ntp['iterations_rolled_back']:g}) | "
            f"{restart['iterations_lost']:g} ({restart['iterations_rolled_back']:g}) | |",
            f"| detection: kill to every survivor aware (s) | {ntp['detect_s']:.3f} | n/a (every rank restarts) | |",
            f"| bytes moved / lower bound | {ntp['moved_bytes']:.0f} / {ntp['lower_bound_bytes']:.0f} | "
            f"n/a (everything reloaded) | {failures['moved_over_lower_bound']:.3f} |"]


def recovery_lines(recovery: dict) -> list[str]:
    lines = ["", f"Recovery, groups made anew against kept ({recovery['job']}), medians:", "",
             "| layout | design | kill to next iteration (s) | re-formation (s) | groups made (all ranks) | "
             "made by a healthy rank | kept |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['design']} | {r['kill_to_next_iteration_s']:.2f} | {r['reform_s']:.2f} | "
              f"{r['groups_made']:g} | {r['groups_made_per_healthy_rank']:g} | {r['groups_kept']:g} |"
              for r in recovery["rows"]]
    lines += ["", "| layout | kept / made anew: kill to next iteration | re-formation |", "|---|---|---|"]
    lines += [f"| {r['layout']} | {_fmt(r['kill_to_next_iteration'], '.3f')} | {_fmt(r['reform'], '.3f')} |"
              for r in recovery["ratios"]]
    return lines


def control_plane_lines(control: list[dict]) -> list[str]:
    lines = ["", "Control plane, one store against two levels (simulated ranks in nodes of 8; "
             "`ntp_megatron/bench/control_plane.py`):", "",
             "| design | ranks | vote p50 (ms) | vote p99 (ms) | node vote p99 (ms) | oldest heartbeat (s) | "
             "root requests/s | false fences | death → generation (s) | death → survivors noted (s) | "
             "bytes read per rank | threads late p99 (ms) | CPU: harness / store (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['design']} | {r['ranks']} | {r['vote_p50_ms']:.1f} | {r['vote_p99_ms']:.1f} | "
              f"{r['node_vote_p99_ms']:.1f} | "
              f"{r['heartbeat_staleness_max_s']:.2f} | {r['requests_per_s']:.0f} | {r['false_fences']} | "
              f"{_fmt(r['failure_to_generation_s'], '.3f')} | {_fmt(r['survivors_noted_s'], '.3f')} | "
              f"{_fmt(r['generation_bytes_per_rank'], '.0f')} | "
              f"{r['arrival_late_p99_ms']:.1f} | {r['harness_cpu_s']:.1f} / {r['store_cpu_s']:.1f} |"
              for r in sorted(control, key=lambda r: (r["ranks"], r["design"] != "two_level"))]  # side by side
    return lines


def init_lines(init: dict) -> list[str]:
    lines = ["", f"Building one rank's model (rank 0 of a TP k replica; {init['model']}), "
             f"{init['rounds']} round(s), one thread:", "",
             "| initialiser | TP | local params (MiB fp32) | best build (s) | × TP1's | median build (s) | "
             "peak RSS over start (MiB) | × TP1's | peak RSS (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in init["cases"].items():
        kind, tp = name.rsplit(" ", 1)
        lines.append(f"| {kind} | {tp[2:]} | {c['local_param_mb']:.0f} | {c['best_build_s']:.2f} | "
                     f"{_fmt(c['best_build_s_over_tp1'], '.2f')} | {c['build_s']:.2f} | "
                     f"{c['peak_over_start_mb']:.0f} | {_fmt(c['peak_over_start_over_tp1'], '.2f')} | "
                     f"{c['peak_rss_mb']:.0f} |")
    return lines


def memory_lines(memory: dict) -> list[str]:
    lines = ["", f"Training state per rank (MiB, the most any rank holds; {memory['layout']}, the reference's "
             f"model, {memory['iterations']} iterations, {memory['rounds']} round(s)):", "",
             "| case | ranks | params | grads | optimizer | shadows | total | RSS high-water (MiB) | "
             "median step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in memory["cases"].items():
        st = c["state"]
        lines.append(f"| {name} | {c['ranks']} | {_mib(st['params'])} | {_mib(st['grads'])} | "
                     f"{_mib(st['optimizer'])} | {_mib(st['shadow_params'] + st['shadow_grads'])} | "
                     f"{_mib(st['total'])} | {c['rss_hwm_mb']:.0f} | {c['median_step_ms']:.1f} |")
    lines += ["", "| comparison | ratio | goal |", "|---|---|---|"]
    lines += [f"| {r['comparison']} | {_fmt(r['ratio'], '.3f')} | {_fmt(r['goal'], '.2f')} |"
              for r in memory["ratios"]]
    for job, rows in memory["reform"].items():
        lines += reform_lines(job, rows)
    return lines


def reform_lines(job: str, rows: list[dict]) -> list[str]:
    """The re-forming ranks' peaks of one failure job (the memory part)."""
    return ["", f"Re-forming ranks' peaks ({job}):", "",
            "| launch rank | role | rebuilt | peak (MiB) | steady before (MiB) | steady after (MiB) | "
            "peak / steady after | peak / steady before | largest message (MiB) |",
            "|---|---|---|---|---|---|---|---|---|",
            *(f"| {r['launch_rank']} | {r['role']} | {'yes' if r['rebuilt'] else 'no'} | "
              f"{_mib(r['peak_bytes'])} | {_mib(r['steady_before_bytes'])} | {_mib(r['steady_after_bytes'])} | "
              f"{r['peak_over_steady_after']:.3f} | {r['peak_over_steady_before']:.3f} | "
              f"{_mib(r['largest_message_bytes'])} |" for r in rows)]


def checkpoint_stall_lines(stall: dict) -> list[str]:
    lines = ["", f"Checkpoint stall, sync against async save ({stall['job']}), medians:", "",
             "| | median iteration gap (s) | training blocked per save (s) | extra wall time per save (s) | "
             "gap after a save − median gap (s) |", "|---|---|---|---|---|"]
    for name, c in stall["cases"].items():
        lines.append(f"| {name} | {c['median_gap_s']:.3f} | {_fmt(c['blocked_per_save_s'], '.3f')} | "
                     f"{_fmt(c['extra_per_save_s'], '.3f')} | {_fmt(c['gap_after_save_minus_median_s'], '.3f')} |")
    lines.append(f"| async / sync | | {_fmt(stall['async_over_sync_blocked_per_save'], '.3f')} | "
                 f"{_fmt(stall['async_over_sync_extra_per_save'], '.3f')} | |")
    return lines


SECTIONS: list[tuple[str, Callable[[Any], list[str]]]] = [
    ("communication", communication_lines),
    ("failure_recovery", failure_lines),
    ("slow_rank", slow_rank.table_lines),
    ("recovery", recovery_lines),
    ("control_plane", control_plane_lines),
    ("init", init_lines),
    ("memory", memory_lines),
    ("checkpoint_stall", checkpoint_stall_lines),
]
"""The JSON key of each part after the step-time cases, in the table's order."""


def table(result: dict) -> str:
    """Every part present in ``result`` (a part that did not run, or measured nothing, has no section)."""
    lines = step_time_lines(result) if result["cases"] else []
    for key, section in SECTIONS:
        if result.get(key):
            lines += section(result[key])
    return "\n".join(lines)
