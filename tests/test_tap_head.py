"""The checkpoint tap head: one typed record from the rank to the forge's owner."""
from __future__ import annotations

import json

import pytest

from flodl_shm import CheckpointMeta, FrameError
from flodl_shm.checkpoint.forge import CheckpointForge, arm_from_head
from flodl_shm.checkpoint.meta import ModelSchema, SaveReason
from flodl_shm.checkpoint.tap_head import TapHead


def _head(**kw) -> TapHead:
    base = dict(cycle=3, part=0, path="/tmp/x.fdl", param_names=["w", "b"],
                buffer_names=["rm"], meta={"epoch": 1})
    base.update(kw)
    return TapHead(**base)


def test_json_round_trip_keeps_every_field():
    h = _head().for_frame(dtype=1, shapes=[[2, 3], (4,)], mass=2.5, round=7,
                          momentum_shapes=[[2, 3], [4]])
    back = TapHead.from_json(h.to_json())
    assert back == h
    assert back.shapes == ((2, 3), (4,)) and back.momentum_shapes == ((2, 3), (4,))
    assert back.tensor_count == 3


def test_next_part_drops_the_frame_fields():
    h = _head().for_frame(dtype=0, shapes=[[2]], mass=1.0, round=4)
    n = h.next_part()
    assert (n.part, n.shapes, n.round, n.mass, n.momentum_shapes) == (1, (), -1, 0.0, None)
    assert (n.cycle, n.path, n.param_names) == (h.cycle, h.path, h.param_names)


def test_arm_fields_round_trip_through_a_control_message():
    h = _head()
    msg = {"type": "arm", **h.arm_fields()}
    json.dumps(msg)  # travels as JSON
    arm = TapHead.from_arm_fields(msg)
    assert arm.arm_only and arm.path == h.path and arm.meta == h.meta
    assert (arm.param_names, arm.buffer_names) == (h.param_names, h.buffer_names)


@pytest.mark.parametrize("text, needle", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"cycle": 1, "part": 0, "path": "p", "param_names": []}).encode(),
     "'buffer_names'"),
    (json.dumps({"cycle": 1, "part": 0, "path": "p", "param_names": [], "buffer_names": [],
                 "shapes": [[1, "x"]]}).encode(), "shapes"),
    (json.dumps({"cycle": 1, "part": 0, "path": "p", "param_names": [], "buffer_names": [],
                 "meta": 5}).encode(), "meta"),
    (json.dumps({"cycle": 1, "part": 0, "path": "p", "param_names": [], "buffer_names": [],
                 "tied": 5}).encode(), "tied must map names to names"),
])
def test_malformed_heads_name_the_field(text, needle):
    with pytest.raises(FrameError, match=needle):
        TapHead.from_json(text)


def test_arm_from_head_reuses_or_rebuilds_the_forge(tmp_path):
    meta = CheckpointMeta.new(0, 5, 1, 2, list(SaveReason)[0])
    h = _head(path=str(tmp_path / "a.fdl"), meta=meta.to_dict())
    f1 = arm_from_head(None, h)
    assert isinstance(f1, CheckpointForge) and f1.is_armed()
    assert f1.schema == ModelSchema(["w", "b"], ["rm"])
    f2 = arm_from_head(f1, _head(path=str(tmp_path / "b.fdl")))
    assert f2 is f1  # same names: the same forge, re-armed
    f3 = arm_from_head(f1, _head(param_names=["w"], path=str(tmp_path / "c.fdl")))
    assert f3 is not f1 and f3.schema == ModelSchema(["w"], ["rm"]) and f3.is_armed()
    for f in (f1, f3):
        f.close(5)


def test_tied_and_non_persistent_names_travel_to_the_forge_by_tap_and_by_arm_message(
        tmp_path):
    """A probe: a Trainer's bundle lost its non-persistent buffers' mark on the way to
    the forge, so its conversion failed a strict load_state_dict ('Unexpected key(s)')."""
    h = _head(path=str(tmp_path / "t.fdl"), tied={"head.w": "w"}, non_persistent=["rm"])
    assert h.tied == (("head.w", "w"),) and h.non_persistent == ("rm",)
    assert TapHead.from_json(h.to_json()) == h
    arm = TapHead.from_arm_fields({"type": "arm", **h.arm_fields()})
    assert (arm.tied, arm.non_persistent) == (h.tied, h.non_persistent)
    assert TapHead.from_json(_head().to_json()).tied == ()
    assert TapHead.from_json(_head().to_json()).non_persistent == ()
    for head in (h, arm):
        forge = arm_from_head(None, head)
        assert forge.schema == ModelSchema(["w", "b"], ["rm"], tied={"head.w": "w"},
                                           non_persistent=["rm"])
        forge.close(5)
