"""The train job's closing table: a label that fills its column keeps a gap before its value,
and the engine's telemetry adds up counts but takes the largest of levels and peaks, over the
steps and the ranks (Note [engine telemetry keys] in _runtime/_telemetry.py); where each rank
runs is one row a rank (Note [rank placement] in _runtime/_topology.py)."""
import pytest

from infinity._apps._train_summary import PLACEMENT_ROWS, _levels, engine_rows, placement_rows, tier_rows
from infinity._runtime._telemetry import StepStats, is_level, render_table, stall_seconds, tier_traffic


def test_a_long_label_keeps_a_gap_before_its_value():
    text = render_table("t", [[("  SSD writes to /tmp/infinity_nvme", "2.4 GB this run")],
                              [("h", "a", "b"), ("  comm_reduce_scatter_bytes", "1.316e+07", "3.949e+07"),
                               ("  short", "1", "2")]])
    assert "  SSD writes to /tmp/infinity_nvme  2.4 GB this run" in text
    long_row, short_row = [line for line in text.splitlines() if "comm_reduce" in line or "short" in line]
    assert "comm_reduce_scatter_bytes " in long_row and long_row.endswith(" 3.949e+07")
    assert len(long_row) == len(short_row)  # the columns stay where they were


def _stats(records):
    stats = StepStats()
    for r in records:
        stats.add(r)
    return stats


def test_counts_are_summed_and_peaks_maxed_over_steps_and_ranks():
    rank0 = _stats([{"engine.bytes.all_gather": 10.0, "engine.host_memory.peak_rss": 1.0e9},
                    {"engine.bytes.all_gather": 30.0, "engine.host_memory.peak_rss": 1.2e9}])
    rank1 = _stats([{"engine.bytes.all_gather": 10.0, "engine.host_memory.peak_rss": 1.5e9}])
    per_rank = [{"levels": _levels(rank0)}, {"levels": _levels(rank1)}]
    counts, levels = engine_rows(rank0, per_rank)
    assert counts[1] == ("  bytes.all_gather", "20", "40")  # mean per step, total over rank 0's steps
    assert levels[0][1:] == ("rank 0 mean", "max, ranks")
    assert levels[1] == ("  host_memory.peak_rss", "1.1e+09", "1.5e+09")  # not 2.2e+09, the sum


@pytest.mark.parametrize("path, level", [("host_memory.rss", True), ("peak_live_parameters", True),
                                         ("prefetch_hit_rate", True), ("stall_s.nvme_read", False),
                                         ("nvme_optimizer_write_bytes", False), ("prefetch_hits", False),
                                         ("tier_seconds.optimizer.nvme", False), ("tier_seconds.params.cpu", False)])
def test_levels_are_told_from_counts(path, level):
    assert is_level(path) is level


def test_where_each_rank_runs_is_a_row_a_rank_up_to_a_bound():
    per_rank = [{"host": "node7", "placement": f"local rank {r}/20: 1 thread(s)"} for r in range(20)]
    rows = placement_rows(per_rank)
    assert rows[0][0] == "where each rank runs"
    assert rows[1] == ("  rank 0 on node7", "local rank 0/20: 1 thread(s)")
    assert len(rows) == 1 + PLACEMENT_ROWS + 1 and rows[-1][0] == f"  {20 - PLACEMENT_ROWS} more rank(s)"
    assert len(placement_rows(per_rank[:2])) == 3
    assert is_level("placement.threads")  # a level: never summed over steps or ranks


def test_each_drive_is_a_row_with_every_ranks_bytes():
    """Note [many drives] in _offload/_drives.py: the engine's drive<k>_*_bytes over the steps,
    per drive, every rank's together, as GB/s over the training time."""
    from types import SimpleNamespace

    import infinity
    from infinity._apps._train_summary import drive_rows, drive_traffic

    cfg = infinity.Config.from_dict({"zero": {"offload_optimizer": {"device": "nvme", "nvme_path": ["/tmp", "/var/tmp"]}}})
    stats = _stats([{"engine.drive1_read_bytes": 2e9, "engine.drive1_write_bytes": 1e9},
                    {"engine.drive1_read_bytes": 2e9, "engine.drive1_write_bytes": 1e9}])
    mine = drive_traffic(SimpleNamespace(cfg=cfg, stats=stats))
    assert mine == {"/var/tmp": {"read": 4e9, "write": 2e9}}  # drive 0 untouched by this rank
    rows = drive_rows([{"drives": mine}, {"drives": {"/tmp": {"read": 1e9, "write": 0.0}}}], elapsed=2.0)
    assert rows == [("  per drive, all ranks (all swap-file I/O)", "read", "write", "moved"),
                    ("    /tmp", "500.0 MB/s", "0 B/s", "1.0 GB"), ("    /var/tmp", "2.0 GB/s", "1.0 GB/s", "6.0 GB")]
    assert drive_rows([{"drives": {"/tmp": {"read": 1.0, "write": 1.0}}}], 1.0) == []  # one drive, one rank


def test_each_state_on_each_tier_is_a_row_of_bytes_and_seconds():
    """``tier_seconds.<state>.<tier>`` (Note [engine telemetry keys] in _runtime/_telemetry.py): a
    row per state and tier with rank 0's mean bytes and seconds per step and the tier's share of
    the state's seconds; bytes the engine does not count there are a dash."""
    step = {"engine.tier_seconds.optimizer.cpu": 0.1, "engine.tier_seconds.optimizer.nvme": 0.3,
            "engine.nvme_optimizer_read_bytes": 2e6, "engine.nvme_optimizer_write_bytes": 1e6,
            "engine.tier_seconds.params.nvme": 0.2, "engine.nvme_params_read_bytes": 5e5,
            "engine.nvme_params_write_bytes": 0.0}
    [rows] = tier_rows(_stats([step, step]))
    assert rows == [("per state and tier, rank 0", "bytes/step", "s/step", "time share"),
                    ("  optimizer on cpu", "-", "0.1000", "25%"), ("  optimizer on nvme", "3.0 MB", "0.3000", "75%"),
                    ("  params on nvme", "500.0 KB", "0.2000", "100%")]
    assert tier_rows(_stats([{"engine.bytes.all_gather": 1.0}])) == []  # an engine without them: no block
    flat = {k[len("engine."):]: v for k, v in step.items()}
    assert stall_seconds(flat) == 0  # seconds on a tier are not a stall ...
    assert tier_traffic({k: v for k, v in flat.items() if k.startswith("tier_seconds")}) == {}  # ... nor traffic
