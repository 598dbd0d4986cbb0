"""Checkpoint metadata: the .meta.json sidecar, death records, bundle paths, ModelSchema.

Ports flodl 0.7.0 ``checkpoint_meta.rs`` tests (seed 001; the ElChe and
coordinator ones land with the training runtime) plus the DESIGN §4 contract.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flodl_shm import (
    CHECKPOINT_META_SCHEMA_VERSION,
    RANK_DEATH_RECORD_SCHEMA_VERSION,
    CheckpointBundle,
    CheckpointError,
    CheckpointMeta,
    CoverageBlock,
    ElCheState,
    EpochCoverage,
    ModelSchema,
    RankDeathRecord,
    SaveReason,
)
from flodl_shm.training.el_che import Phase

ALL_REASONS = [
    SaveReason.GRACEFUL_SHUTDOWN,
    SaveReason.MAX_FAILURE_EXCEEDED,
    SaveReason.SINGLE_SURVIVOR,
    SaveReason.ALL_RANKS_LOST,
    SaveReason.REDUCE_STALL,
    SaveReason.CHECKPOINT,
]


# --- paths ---------------------------------------------------------------------


def test_sidecar_path_from_stem_appends_meta_json():
    assert CheckpointMeta.sidecar_path("/tmp/run/ckpt_final") == Path("/tmp/run/ckpt_final.meta.json")


def test_sidecar_path_from_fdl_strips_extension():
    assert CheckpointMeta.sidecar_path("/tmp/run/ckpt_final.fdl") == Path("/tmp/run/ckpt_final.meta.json")


def test_rank_death_path_is_per_rank_and_shares_stem():
    assert CheckpointBundle.rank_death_path("/tmp/run/ckpt_final", 2) == Path(
        "/tmp/run/ckpt_final.rank2.death.json")
    # A stem carrying a bundle extension drops it, like the siblings.
    assert CheckpointBundle.rank_death_path("/tmp/run/ckpt.fdl", 0) == Path(
        "/tmp/run/ckpt.rank0.death.json")
    # Distinct ranks never collide.
    assert CheckpointBundle.rank_death_path("ckpt", 0) != CheckpointBundle.rank_death_path("ckpt", 1)
    # each rank's resume state follows the same rule
    assert CheckpointBundle.rank_state_path("/tmp/run/ckpt.fdl", 3) == Path(
        "/tmp/run/ckpt.rank3.optim")
    with pytest.raises(ValueError):
        CheckpointBundle.rank_state_path("ckpt", -1)


def test_bundle_paths_share_stem():
    stem = "/tmp/run/ckpt_final"
    assert CheckpointBundle.model_path(stem) == Path("/tmp/run/ckpt_final.fdl")
    assert CheckpointBundle.optim_path(stem) == Path("/tmp/run/ckpt_final.optim")
    assert CheckpointBundle.meta_path(stem) == Path("/tmp/run/ckpt_final.meta.json")
    assert CheckpointBundle.config_sidecar_path(stem) == Path("/tmp/run/ckpt_final.config.json")


def test_bundle_paths_strip_existing_extension():
    stem = "/tmp/run/ckpt.fdl"
    assert CheckpointBundle.model_path(stem) == Path("/tmp/run/ckpt.fdl")
    assert CheckpointBundle.optim_path(stem) == Path("/tmp/run/ckpt.optim")
    assert CheckpointBundle.meta_path(stem) == Path("/tmp/run/ckpt.meta.json")


@pytest.mark.parametrize("stem, model, meta", [
    # PathBuf::set_extension: only the last extension goes; a leading dot is no extension.
    ("runs/a.b/ckpt", "runs/a.b/ckpt.fdl", "runs/a.b/ckpt.meta.json"),
    ("ckpt.tar.gz", "ckpt.tar.fdl", "ckpt.tar.meta.json"),
    (".hidden", ".hidden.fdl", ".hidden.meta.json"),
    ("ckpt.", "ckpt.fdl", "ckpt.meta.json"),
])
def test_bundle_paths_follow_rust_set_extension(stem, model, meta):
    assert CheckpointBundle.model_path(stem) == Path(model)
    assert CheckpointBundle.meta_path(stem) == Path(meta)


def test_bundle_paths_accept_pathlike_and_return_path():
    p = CheckpointBundle.optim_path(Path("/r") / "ckpt.fdl")
    assert isinstance(p, Path) and p == Path("/r/ckpt.optim")


def test_bundle_path_without_file_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no file name"):
        CheckpointBundle.model_path("")


def test_a_stem_that_ends_with_a_separator_is_refused_naming_a_stem_inside():
    """'runs/job/' reads as a directory, but the files would land beside it
    (runs/job.fdl): refused, with the stem to pass instead."""
    with pytest.raises(ValueError, match=r"ends with a separator.*'runs/job/ckpt'"):
        CheckpointBundle.model_path("runs/job/")
    assert CheckpointBundle.model_path(Path("runs/job/")) == Path("runs/job.fdl")  # no slash


# --- save reason ---------------------------------------------------------------


def test_save_reason_u8_roundtrip_for_all_variants():
    for r in ALL_REASONS:
        assert SaveReason.from_u8(r.to_u8()) is r


def test_save_reason_byte_codes_are_stable():
    # Part of the wire contract: existing values never change.
    assert [r.to_u8() for r in ALL_REASONS] == [0, 1, 2, 3, 4, 5]


def test_save_reason_from_unknown_byte_is_none():
    assert SaveReason.from_u8(99) is None
    assert SaveReason.from_u8(255) is None
    assert SaveReason.from_u8(6) is None


def test_save_reason_is_a_str_enum_of_snake_case_names():
    assert SaveReason.SINGLE_SURVIVOR == "single_survivor"
    assert [r.value for r in ALL_REASONS] == [
        "graceful_shutdown", "max_failure_exceeded", "single_survivor", "all_ranks_lost",
        "reduce_stall", "checkpoint"]


def test_save_reason_serializes_snake_case():
    meta = CheckpointMeta.new(0, 0, 0, 1, SaveReason.SINGLE_SURVIVOR)
    compact = json.dumps(meta.to_dict(), separators=(",", ":"))
    assert '"save_reason":"single_survivor"' in compact


# --- the sidecar ---------------------------------------------------------------


def test_roundtrip_json_preserves_all_fields(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    CheckpointMeta.new(3, 7500, 12, 4, SaveReason.MAX_FAILURE_EXCEEDED).write_to_file(path)
    loaded = CheckpointMeta.read_from_file(path)
    assert loaded.epoch == 3
    assert loaded.global_step == 7500
    assert loaded.sync_round == 12
    assert loaded.world_size_at_save == 4
    assert loaded.save_reason is SaveReason.MAX_FAILURE_EXCEEDED
    assert loaded.schema_version == CHECKPOINT_META_SCHEMA_VERSION == 4
    assert loaded.elche_state is None and loaded.coverage is None


def test_written_json_is_flodls_pretty_layout(tmp_path):
    # serde_json::to_string_pretty: 2-space indent, `"key": value`, null optionals,
    # struct field order. flodl reads what we write and vice versa.
    path = tmp_path / "ckpt.meta.json"
    CheckpointMeta.new(1, 2, 3, 4, SaveReason.CHECKPOINT).write_to_file(path)
    assert path.read_text() == (
        '{\n'
        '  "schema_version": 4,\n'
        '  "epoch": 1,\n'
        '  "global_step": 2,\n'
        '  "sync_round": 3,\n'
        '  "world_size_at_save": 4,\n'
        '  "save_reason": "checkpoint",\n'
        '  "elche_state": null,\n'
        '  "coverage": null\n'
        '}'
    )


def test_write_is_atomic_and_leaves_no_temp(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    CheckpointMeta.new(1, 1, 1, 1, SaveReason.CHECKPOINT).write_to_file(str(path))
    CheckpointMeta.new(2, 2, 2, 2, SaveReason.GRACEFUL_SHUTDOWN).write_to_file(path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.meta.json"]
    assert CheckpointMeta.read_from_file(path).epoch == 2


def test_builders_return_new_objects():
    base = CheckpointMeta.new(0, 0, 0, 2, SaveReason.CHECKPOINT)
    state = ElCheState(4, 0, [1.0, 2.0], Phase.WARMUP, 1)
    with_state = base.with_elche_state(state)
    with_cov = with_state.with_coverage(CoverageBlock(7, 8, []))
    assert base.elche_state is None and base.coverage is None
    assert with_state.elche_state == state and with_state.coverage is None
    assert with_cov.elche_state == state and with_cov.coverage == CoverageBlock(7, 8, [])


def test_roundtrip_preserves_elche_state(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    state = ElCheState(
        anchor=12,
        anchor_rank=1,
        smoothed_ms_per_batch=[5.0, 2.5, 4.0],
        phase=Phase.STABLE,
        calibration_count=42,
        trend_history=[0.01, 0.015, 0.02, 0.025, 0.03],
    )
    CheckpointMeta.new(3, 7500, 12, 3, SaveReason.GRACEFUL_SHUTDOWN).with_elche_state(
        state).write_to_file(path)
    loaded = CheckpointMeta.read_from_file(path)
    assert loaded.elche_state == state
    assert loaded.elche_state.phase == "stable"


def test_roundtrip_preserves_coverage(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    coverage = CoverageBlock(
        seed=42,
        batch_size=32,
        per_epoch=[
            EpochCoverage(epoch=7, total_samples=1024, uncovered_ranges=[(320, 64), (640, 384)]),
            EpochCoverage(epoch=8, total_samples=1024, uncovered_ranges=[(0, 1024)]),
        ],
    )
    CheckpointMeta.new(7, 7500, 12, 3, SaveReason.GRACEFUL_SHUTDOWN).with_coverage(
        coverage).write_to_file(path)
    loaded = CheckpointMeta.read_from_file(path)
    assert loaded.coverage == coverage
    assert loaded.coverage.per_epoch[0].uncovered_ranges == [(320, 64), (640, 384)]
    assert loaded.schema_version == CHECKPOINT_META_SCHEMA_VERSION
    # On disk the ranges are [offset, size] pairs, as serde writes tuples.
    raw = json.loads(path.read_text())
    assert raw["coverage"]["per_epoch"][0]["uncovered_ranges"] == [[320, 64], [640, 384]]


def test_coverage_keeps_the_dataset_length_only_where_known():
    """Our coverage records the dataset's length (a resume check); flodl's files and
    ours of earlier releases lack it and read as None, and a coverage without it is
    written as flodl writes it."""
    flodl = {"seed": 1, "batch_size": 4, "per_epoch": []}
    assert CoverageBlock.from_dict(flodl).dataset_len is None
    assert CoverageBlock.from_dict(flodl).to_dict() == flodl
    ours = CoverageBlock(1, 4, [], dataset_len=17)
    assert ours.to_dict() == {**flodl, "dataset_len": 17}
    assert CoverageBlock.from_dict(ours.to_dict()) == ours
    with pytest.raises(CheckpointError, match=r"coverage\.dataset_len"):
        CoverageBlock.from_dict({**flodl, "dataset_len": -3})


def test_seed_is_a_full_u64():
    cov = CoverageBlock(seed=2**64 - 1, batch_size=1, per_epoch=[])
    meta = CheckpointMeta.new(0, 0, 0, 1, SaveReason.CHECKPOINT).with_coverage(cov)
    assert CheckpointMeta.from_dict(json.loads(meta.to_json())).coverage.seed == 2**64 - 1


def test_v1_file_loads_with_elche_state_defaulted_to_none(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    path.write_text("""{
        "schema_version": 1,
        "epoch": 5,
        "global_step": 10000,
        "sync_round": 25,
        "world_size_at_save": 2,
        "save_reason": "graceful_shutdown"
    }""")
    loaded = CheckpointMeta.read_from_file(path)
    assert loaded.schema_version == 1
    assert loaded.epoch == 5
    assert loaded.elche_state is None
    assert loaded.coverage is None


def test_v2_file_loads_with_trend_history_defaulted_to_none(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    path.write_text("""{
        "schema_version": 2,
        "epoch": 5,
        "global_step": 10000,
        "sync_round": 25,
        "world_size_at_save": 2,
        "save_reason": "graceful_shutdown",
        "elche_state": {
            "anchor": 8,
            "anchor_rank": 0,
            "smoothed_ms_per_batch": [3.0, 5.0],
            "phase": "stable",
            "calibration_count": 17
        }
    }""")
    loaded = CheckpointMeta.read_from_file(path)
    assert loaded.schema_version == 2
    assert loaded.elche_state is not None
    assert loaded.elche_state.anchor == 8
    assert loaded.elche_state.trend_history is None


def test_v3_file_loads_with_coverage_defaulted_to_none(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    path.write_text("""{
        "schema_version": 3,
        "epoch": 5,
        "global_step": 10000,
        "sync_round": 25,
        "world_size_at_save": 2,
        "save_reason": "graceful_shutdown",
        "elche_state": {
            "anchor": 8,
            "anchor_rank": 0,
            "smoothed_ms_per_batch": [3.0, 5.0],
            "phase": "stable",
            "calibration_count": 17,
            "trend_history": [0.01, 0.02, 0.03]
        }
    }""")
    loaded = CheckpointMeta.read_from_file(path)
    assert loaded.schema_version == 3
    assert loaded.elche_state is not None
    assert loaded.elche_state.trend_history == [0.01, 0.02, 0.03]
    assert loaded.coverage is None


def test_future_schema_version_rejected(tmp_path):
    path = tmp_path / "ckpt.meta.json"
    path.write_text("""{
        "schema_version": 99999,
        "epoch": 0,
        "global_step": 0,
        "sync_round": 0,
        "world_size_at_save": 1,
        "save_reason": "graceful_shutdown"
    }""")
    with pytest.raises(CheckpointError, match="newer than") as info:
        CheckpointMeta.read_from_file(path)
    assert "99999" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text, needle", [
    ("{not json", "parse JSON"),
    ("[1, 2]", "not an object"),
    ('{"schema_version": 4, "epoch": 0, "global_step": 0, "sync_round": 0,'
     ' "world_size_at_save": 1}', "save_reason"),
    ('{"schema_version": 4, "epoch": -1, "global_step": 0, "sync_round": 0,'
     ' "world_size_at_save": 1, "save_reason": "checkpoint"}', "epoch"),
    ('{"schema_version": 4, "epoch": 0, "global_step": 0, "sync_round": 0,'
     ' "world_size_at_save": 1, "save_reason": "exploded"}', "exploded"),
    ('{"schema_version": 4, "epoch": 0, "global_step": 0, "sync_round": 0,'
     ' "world_size_at_save": 1, "save_reason": "checkpoint", "elche_state": {"anchor": 1,'
     ' "anchor_rank": null, "smoothed_ms_per_batch": [], "phase": "sleepy",'
     ' "calibration_count": 0}}', "sleepy"),
])
def test_malformed_sidecars_fail_naming_the_problem(tmp_path, text, needle):
    path = tmp_path / "bad.meta.json"
    path.write_text(text)
    with pytest.raises(CheckpointError, match=needle):
        CheckpointMeta.read_from_file(path)


def test_missing_sidecar_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="nope.meta.json"):
        CheckpointMeta.read_from_file(tmp_path / "nope.meta.json")


# --- death records -------------------------------------------------------------


def test_rank_death_record_round_trips_json(tmp_path):
    path = tmp_path / "ckpt.rank1.death.json"
    RankDeathRecord.new(1, 4, "boom: cuda OOM").write_to_file(path)
    raw = json.loads(path.read_text())
    assert raw["rank"] == 1
    assert raw["world_size"] == 4
    assert raw["error"] == "boom: cuda OOM"
    assert raw["schema_version"] == RANK_DEATH_RECORD_SCHEMA_VERSION == 1
    assert set(raw) == {"schema_version", "rank", "world_size", "error", "unix_time_secs"}
    back = RankDeathRecord.read_from_file(path)
    assert (back.rank, back.world_size, back.error) == (1, 4, "boom: cuda OOM")
    assert back.unix_time_secs == raw["unix_time_secs"] > 1_600_000_000


# --- model schema --------------------------------------------------------------


def test_model_schema_from_module_names_a_non_module():
    with pytest.raises(TypeError, match=r"takes a torch.nn.Module, got int 5"):
        ModelSchema.from_module(5)


def test_model_schema_from_module_captures_ordered_names():
    schema = ModelSchema.from_module(torch.nn.Linear(4, 2))
    assert schema.param_names == ["weight", "bias"]
    assert schema.buffer_names == []
    assert schema.tensor_count() == 2


def test_model_schema_keeps_only_the_averaged_float_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    schema = ModelSchema.from_module(model)
    assert schema.param_names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    # num_batches_tracked (int64) stays local to each rank: not averaged, not in the schema.
    assert schema.buffer_names == ["1.running_mean", "1.running_var"]
    assert schema.tensor_count() == 8


def test_model_schema_dict_round_trip():
    schema = ModelSchema(["a", "b"], ["c"])
    assert ModelSchema.from_dict(schema.to_dict()) == schema


def test_new_refuses_what_its_own_reader_would_refuse(tmp_path):
    """CheckpointMeta.new and RankDeathRecord.new took anything and wrote files that
    read_from_file then refused (a negative epoch, a str count, an unknown reason)."""
    from flodl_shm import CheckpointError, CheckpointMeta, RankDeathRecord, SaveReason

    with pytest.raises(CheckpointError, match=r"epoch = -1 is out of range"):
        CheckpointMeta.new(-1, 0, 0, 2, SaveReason.CHECKPOINT)
    with pytest.raises(CheckpointError, match=r"global_step must be a non-negative integer, "
                                              r"got 1.5"):
        CheckpointMeta.new(0, 1.5, 0, 2, SaveReason.CHECKPOINT)
    with pytest.raises(CheckpointError, match=r"save_reason = 'bogus' is not a known save "
                                              r"reason \(graceful_shutdown, "):
        CheckpointMeta.new(0, 0, 0, 2, "bogus")
    with pytest.raises(CheckpointError, match=r"rank = -1 is out of range"):
        RankDeathRecord.new(-1, 2, "boom")
    meta = CheckpointMeta.new(1, 2, 3, 2, "checkpoint")  # the reason by its JSON name
    meta.write_to_file(tmp_path / "ck.meta.json")
    assert CheckpointMeta.read_from_file(tmp_path / "ck.meta.json") == meta
