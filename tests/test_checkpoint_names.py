"""A consensus checkpoint carries its model's names: ``<stem>.names.json``.

The ``.fdl`` keeps flodl's positional keys (``p{i}`` / ``b{j}``); the forge writes
the ``ModelSchema`` next to it, first, and every converter renames the keys with
it, so ``model.load_state_dict(torch.load(converted))`` works as it does for any
torch checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flodl_shm import CheckpointError, load_consensus_checkpoint
from flodl_shm.checkpoint.convert import (consensus_state_dict, convert, fdl_to_state_dict,
                                          load_safetensors, state_dict_to_consensus_fdl)
from flodl_shm.checkpoint.fdl import read_fdl
from flodl_shm.checkpoint.forge import CheckpointForge, outer_sidecar_path
from flodl_shm.checkpoint.meta import ModelSchema, names_sidecar_path
from flodl_shm.checkpoint.series import bundle_files, prune_series, round_model_path
from flodl_shm.cli import fdl as cli
from flodl_shm.frame import tensors_to_round_frame


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model(torch.randn(8, 3))  # BatchNorm running stats away from their init
    return model


def forge_checkpoint(model, path: Path, momentum=None) -> None:
    """The consensus of ``model`` written as the Trainer's forge writes it."""
    forge = CheckpointForge(ModelSchema.from_module(model))
    forge.arm(path)
    if momentum is not None:
        forge.stash_outer_momentum(tensors_to_round_frame(momentum).tensors)
    forge.accumulate(tensors_to_round_frame([p.detach() for p in model.parameters()]))
    forge.accumulate(tensors_to_round_frame(
        [b for _, b in model.named_buffers() if b.is_floating_point()]))
    assert forge.flush(30) and forge.writes_failed == 0


def assert_same_state(model, other) -> None:
    for (k, v), (k2, v2) in zip(model.state_dict().items(), other.state_dict().items()):
        assert k == k2
        if v.is_floating_point():
            assert torch.equal(v, v2), k


def test_names_sidecar_paths():
    for model in ("r/x.fdl", "r/x.fdl.gz", "r/x.outer.fdl", "r/x.outer.fdl.gz"):
        assert names_sidecar_path(model) == Path("r/x.names.json")
    assert names_sidecar_path("r/x-r00000012.fdl") == Path("r/x-r00000012.names.json")
    assert names_sidecar_path("r/x.pt") == Path("r/x.names.json")


def test_the_forge_writes_the_names_with_the_model(tmp_path):
    model = make_model()
    path = tmp_path / "c.fdl"
    forge_checkpoint(model, path)
    side = tmp_path / "c.names.json"
    assert ModelSchema.read_from_file(side) == ModelSchema.from_module(model)
    doc = json.loads(side.read_text())
    assert doc["schema_version"] == 1
    assert doc["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight",
                                  "3.bias"]
    assert doc["buffer_names"] == ["1.running_mean", "1.running_var"]
    assert "tied" not in doc  # only a model that shares tensors has the field
    # the .fdl itself is unchanged: flodl's positional keys, nothing else
    assert [e.name for e in read_fdl(path).entries] == [f"p{i}" for i in range(6)] + ["b0", "b1"]
    assert load_consensus_checkpoint(make_model(1), path).complete


@pytest.mark.parametrize("dst", ["c.pt", "c.safetensors"])
def test_converted_consensus_loads_with_load_state_dict(tmp_path, dst, capsys):
    model = make_model()
    forge_checkpoint(model, tmp_path / "c.fdl")
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / dst)]) == 0
    assert "keys named from c.names.json" in capsys.readouterr().out
    if dst.endswith(".pt"):
        state = torch.load(tmp_path / dst)
    else:
        state = load_safetensors(tmp_path / dst)[0]
    fresh = make_model(1)
    fresh.load_state_dict(state)  # strict: every name is the model's own
    assert_same_state(model, fresh)


def test_a_consensus_converted_without_its_names_says_how_to_get_them(tmp_path, capsys):
    """A probe converted a bundle's .fdl whose .names.json was not copied with it: the
    output kept p0, p1, ... without a word, and load_state_dict refused it later."""
    from flodl_shm.checkpoint.convert import consensus_state_dict

    model = make_model()
    forge_checkpoint(model, tmp_path / "c.fdl")
    names = (tmp_path / "c.names.json").read_bytes()
    (tmp_path / "c.names.json").unlink()
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / "c.pt")]) == 0
    said = capsys.readouterr()
    assert said.err.startswith(f"note: {tmp_path / 'c.fdl'} has no c.names.json next to it, "
                               f"so {tmp_path / 'c.pt'} keeps its positional keys (p0, p1, ..."), \
        said.err
    assert "consensus_state_dict(" in said.err
    fresh = make_model(1)
    fresh.load_state_dict(consensus_state_dict(tmp_path / "c.fdl", fresh))  # the way it names
    assert_same_state(model, fresh)
    assert cli.main(["convert", str(tmp_path / "c.pt"), str(tmp_path / "d.fdl")]) == 0
    assert cli.main(["convert", "--keep-keys", str(tmp_path / "c.fdl"),
                     str(tmp_path / "e.pt")]) == 0
    (tmp_path / "c.names.json").write_bytes(names)
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / "f.pt")]) == 0
    assert "note:" not in capsys.readouterr().err  # (asked to keep them, or names found)


def test_fdl_to_fdl_keeps_positional_keys_and_copies_the_names(tmp_path):
    model = make_model()
    forge_checkpoint(model, tmp_path / "c.fdl")
    assert convert(tmp_path / "c.fdl", tmp_path / "d.fdl.gz") == 8
    assert [e.name for e in read_fdl(tmp_path / "d.fdl.gz").entries][0] == "p0"
    assert (tmp_path / "d.names.json").read_bytes() == (tmp_path / "c.names.json").read_bytes()
    fresh = make_model(1)
    assert load_consensus_checkpoint(fresh, tmp_path / "d.fdl.gz").complete
    assert_same_state(model, fresh)
    assert list(fdl_to_state_dict(tmp_path / "d.fdl.gz"))[:2] == ["0.weight", "0.bias"]


def test_the_outer_momentum_sidecar_converts_to_parameter_names(tmp_path):
    model = make_model()
    momentum = [torch.full_like(p, float(i)) for i, p in enumerate(model.parameters())]
    forge_checkpoint(model, tmp_path / "c.fdl", momentum=momentum)
    outer = outer_sidecar_path(tmp_path / "c.fdl")
    named = fdl_to_state_dict(outer)
    assert list(named) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(named[n], m) for (n, _), m in zip(model.named_parameters(), momentum))



def test_an_outer_momentum_file_converted_without_its_names_says_what_it_holds(tmp_path,
                                                                                capsys):
    """The note for a consensus without its names advised load_state_dict and
    consensus_state_dict for a bundle's .outer.fdl too, which holds momentum, not
    weights."""
    model = make_model()
    momentum = [torch.full_like(p, float(i)) for i, p in enumerate(model.parameters())]
    forge_checkpoint(model, tmp_path / "c.fdl", momentum=momentum)
    (tmp_path / "c.names.json").unlink()
    outer = outer_sidecar_path(tmp_path / "c.fdl")
    assert cli.main(["convert", str(outer), str(tmp_path / "m.pt")]) == 0
    said = capsys.readouterr().err
    assert said.startswith(f"note: {outer} has no c.names.json next to it, so "
                           f"{tmp_path / 'm.pt'} keeps its positional keys (p0, p1, ...: the "
                           f"outer optimizer's momentum of each parameter"), said
    assert "load_state_dict" not in said and "consensus_state_dict" not in said
    assert list(torch.load(tmp_path / "m.pt")) == [f"p{i}" for i in range(len(momentum))]

def test_keep_keys_and_files_without_names(tmp_path, capsys):
    model = make_model()
    forge_checkpoint(model, tmp_path / "c.fdl")
    assert cli.main(["convert", "--keep-keys", str(tmp_path / "c.fdl"), str(tmp_path / "k.pt")]) == 0
    assert list(torch.load(tmp_path / "k.pt"))[0] == "p0"
    assert list(fdl_to_state_dict(tmp_path / "c.fdl", names=None))[0] == "p0"
    # names given explicitly work without a sidecar; without either, a clear error
    (tmp_path / "c.names.json").unlink()
    assert list(consensus_state_dict(tmp_path / "c.fdl", model))[0] == "0.weight"
    with pytest.raises(CheckpointError, match="no c.names.json next to it: pass the model"):
        consensus_state_dict(tmp_path / "c.fdl")
    assert list(fdl_to_state_dict(tmp_path / "c.fdl"))[0] == "p0"


def test_a_names_file_of_another_model_is_refused(tmp_path):
    forge_checkpoint(make_model(), tmp_path / "c.fdl")
    ModelSchema(["w"], []).write_to_file(tmp_path / "c.names.json")
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['p1'.*--keep-keys"):
        convert(tmp_path / "c.fdl", tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()
    assert cli.main(["show", str(tmp_path / "c.fdl")]) == 0  # show still lists the file


def test_state_dict_to_consensus_fdl_writes_the_names(tmp_path):
    model = make_model()
    state_dict_to_consensus_fdl(model.state_dict(), model, tmp_path / "s.fdl")
    assert ModelSchema.read_from_file(tmp_path / "s.names.json") == ModelSchema.from_module(model)
    fresh = make_model(1)
    fresh.load_state_dict(fdl_to_state_dict(tmp_path / "s.fdl"))
    assert_same_state(model, fresh)


def test_fdl_show_lists_the_model_names(tmp_path, capsys):
    forge_checkpoint(make_model(), tmp_path / "c.fdl")
    assert cli.main(["show", str(tmp_path / "c.fdl")]) == 0
    out = capsys.readouterr().out
    assert "model names: c.names.json" in out
    assert ["6", "b0", "1.running_mean", "f32", "[4]", "16"] in [ln.split() for ln in
                                                               out.splitlines()]
    assert cli.main(["show", "--json", str(tmp_path / "c.fdl")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"][0]["model_name"] == "0.weight"


def test_series_prunes_the_names_with_the_bundle(tmp_path):
    stem = tmp_path / "run"
    model = make_model()
    for rnd in (1, 2, 3):
        forge_checkpoint(model, round_model_path(stem, rnd))
        (tmp_path / f"run-r{rnd:08d}.meta.json").write_text("{}")
    assert names_sidecar_path(round_model_path(stem, 1)) in bundle_files(round_model_path(stem, 1))
    assert prune_series(stem, keep=1) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "run-r00000003.fdl", "run-r00000003.meta.json", "run-r00000003.names.json"]


class TiedHead(torch.nn.Module):
    """An output head that reuses the embedding's weight (as GPT-2 and most small LMs
    do): ``parameters()`` lists it once, ``state_dict()`` under both names."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.norm(self.emb(x)))


def test_tied_names_are_recorded_and_validated(tmp_path):
    schema = ModelSchema.from_module(TiedHead())
    assert schema.param_names == ["emb.weight", "norm.weight", "norm.bias"]
    assert schema.tied == {"head.weight": "emb.weight"}
    forge_checkpoint(TiedHead(), tmp_path / "c.fdl")
    assert json.loads((tmp_path / "c.names.json").read_text())["tied"] == {
        "head.weight": "emb.weight"}
    assert ModelSchema.read_from_file(tmp_path / "c.names.json") == schema
    with pytest.raises(CheckpointError, match=r"tied\['x'\] = 'nope'.*one it carries"):
        ModelSchema(["w"], [], tied={"x": "nope"})
    with pytest.raises(CheckpointError, match="tied must map names to names"):
        ModelSchema.from_dict({"param_names": ["w"], "buffer_names": [], "tied": ["w"]})


@pytest.mark.parametrize("dst", ["c.pt", "c.safetensors"])
def test_a_model_with_tied_weights_converts_to_a_strictly_loadable_state_dict(tmp_path, dst):
    model = TiedHead()
    model(torch.randint(0, 10, (8,)))  # BatchNorm statistics away from their init
    forge_checkpoint(model, tmp_path / "c.fdl")
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / dst)]) == 0
    state = (torch.load(tmp_path / dst) if dst.endswith(".pt")
             else load_safetensors(tmp_path / dst)[0])
    assert torch.equal(state["head.weight"], state["emb.weight"])
    fresh = TiedHead(seed=1)
    fresh.load_state_dict(state)  # strict: the tied name is there too
    assert fresh.head.weight is fresh.emb.weight
    assert_same_state(model, fresh)
    # a model's own state_dict, tied names included, goes back into a consensus file
    state_dict_to_consensus_fdl(model.state_dict(), model, tmp_path / "s.fdl")
    assert [e.name for e in read_fdl(tmp_path / "s.fdl").entries] == ["p0", "p1", "p2", "b0",
                                                                      "b1"]
    TiedHead(seed=2).load_state_dict(consensus_state_dict(tmp_path / "s.fdl"))


class Rotary(torch.nn.Module):
    """A float buffer registered with ``persistent=False`` (a rotary embedding's
    ``inv_freq``), inside a submodule: carried and averaged, absent from state_dict()."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 3)
        self.rope = torch.nn.Module()
        self.rope.register_buffer("inv_freq", torch.rand(2), persistent=False)


@pytest.mark.parametrize("dst", ["c.pt", "c.safetensors"])
def test_non_persistent_buffers_are_carried_but_left_out_of_converted_state_dicts(tmp_path, dst):
    """The converters emit what ``state_dict()`` holds: a model with a non-persistent
    buffer used to get a file its strict ``load_state_dict`` refused ('Unexpected
    key(s): rope.inv_freq'), and its own state_dict could not become a consensus file
    ('state_dict has no entry')."""
    model = Rotary()
    schema = ModelSchema.from_module(model)
    assert schema.buffer_names == ["rope.inv_freq"] and schema.non_persistent == ["rope.inv_freq"]
    forge_checkpoint(model, tmp_path / "c.fdl")
    assert ModelSchema.read_from_file(tmp_path / "c.names.json") == schema
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / dst)]) == 0
    state = (torch.load(tmp_path / dst) if dst.endswith(".pt")
             else load_safetensors(tmp_path / dst)[0])
    assert sorted(state) == ["lin.bias", "lin.weight"]
    Rotary(seed=1).load_state_dict(state)  # strict
    Rotary(seed=1).load_state_dict(consensus_state_dict(tmp_path / "c.fdl"))
    fresh = Rotary(seed=1)  # the checkpoint still carries the buffer for a resume
    assert not load_consensus_checkpoint(fresh, tmp_path / "c.fdl").missing
    assert torch.equal(fresh.rope.inv_freq, model.rope.inv_freq)
    # a model's own state_dict goes back into a consensus file, the buffer from the model
    state_dict_to_consensus_fdl(model.state_dict(), model, tmp_path / "s.fdl")
    assert [e.name for e in read_fdl(tmp_path / "s.fdl").entries] == ["p0", "p1", "b0"]
    with pytest.raises(CheckpointError, match="non-persistent buffer.*pass the model itself"):
        state_dict_to_consensus_fdl(model.state_dict(), schema, tmp_path / "t.fdl")
    with pytest.raises(CheckpointError, match="not among its buffers"):
        ModelSchema(["w"], [], non_persistent=["x"])


def test_fdl_given_a_series_stem_names_its_newest_bundle(tmp_path, capsys):
    stem = tmp_path / "run"
    for rnd in (4, 8):
        forge_checkpoint(make_model(), round_model_path(stem, rnd))
        (tmp_path / f"run-r{rnd:08d}.meta.json").write_text("{}")
    assert cli.main(["show", str(stem)]) == 1
    err = capsys.readouterr().err
    assert f"{stem} names a checkpoint series, whose newest bundle is " \
           f"{round_model_path(stem, 8)}" in err
    assert cli.main(["show", str(tmp_path / "none.fdl")]) == 1
    assert "checkpoint series" not in capsys.readouterr().err


def test_convert_refuses_to_write_over_its_source_or_a_bundle_s_model(tmp_path, capsys):
    """`fdl convert m.pt runs/demo/ckpt-r00000006.fdl` replaced a run's consensus model by
    one keyed by names, and the run could not resume; `fdl convert X X` "succeeded"."""
    model = make_model()
    forge_checkpoint(model, tmp_path / "c.fdl")
    (tmp_path / "c.meta.json").write_text("{}")  # c.fdl is a bundle's model file
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / "m.pt")]) == 0
    before = (tmp_path / "c.fdl").read_bytes()
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "c.fdl")]) == 2
    assert "c.fdl is a file of the checkpoint bundle committed by c.meta.json" in \
        capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "m.pt")]) == 2
    assert "m.pt is the file being converted" in capsys.readouterr().err
    assert (tmp_path / "c.fdl").read_bytes() == before
    assert cli.main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "m2.pt")]) == 0
    assert cli.main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "m2.pt")]) == 0  # a file
    # of no bundle is replaced, as before


def test_convert_keeps_off_every_file_of_a_committed_bundle(tmp_path, capsys):
    """A probe converted a checkpoint over a bundle's .meta.json (`--to safetensors`), its
    rank state (`--to torch`) and its .names.json (`--to fdl`): each "succeeded", and the
    run's resume failed on a .meta.json that was not JSON. A .fdl written beside a bundle
    under its stem (x.fdl.gz, x.outer.fdl) rewrote the bundle's x.names.json too."""
    model = make_model()
    forge_checkpoint(model, tmp_path / "src.fdl")
    forge_checkpoint(model, tmp_path / "c.fdl")
    (tmp_path / "c.meta.json").write_text("{}")
    (tmp_path / "c.rank0.optim").write_bytes(b"state")
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for dst, fmt in (("c.meta.json", "safetensors"), ("c.rank0.optim", "torch"),
                     ("c.names.json", "fdl"), ("c.fdl.gz", None), ("c.outer.fdl", None),
                     ("c.rank1.optim", "torch"), ("c.config.json", "torch")):
        argv = ["convert", str(tmp_path / "src.fdl"), str(tmp_path / dst)]
        assert cli.main(argv + (["--to", fmt] if fmt else [])) == 2, dst
        err = capsys.readouterr().err
        assert "of the checkpoint bundle committed by c.meta.json" in err, err
        assert "write the result to another path" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    # a stem of its own beside the bundle is fine, and so is a bundle not yet committed
    assert cli.main(["convert", str(tmp_path / "src.fdl"), str(tmp_path / "d.fdl.gz")]) == 0
    (tmp_path / "c.meta.json").unlink()
    assert cli.main(["convert", str(tmp_path / "src.fdl"), str(tmp_path / "c.outer.fdl")]) == 0


def test_names_given_twice_are_refused_rather_than_dropping_a_tensor(tmp_path, capsys):
    """A .names.json naming two tensors alike made `fdl convert` write 3 tensors of 4."""
    model = make_model()
    forge_checkpoint(model, tmp_path / "c.fdl")
    names = json.loads((tmp_path / "c.names.json").read_text())
    names["param_names"][1] = names["param_names"][0]
    (tmp_path / "c.names.json").write_text(json.dumps(names))
    assert cli.main(["convert", str(tmp_path / "c.fdl"), str(tmp_path / "m.pt")]) == 1
    assert "more than once among its params and buffers" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()
    with pytest.raises(CheckpointError, match="more than once"):
        ModelSchema(["a", "a"], [])


@pytest.mark.parametrize("path", ["", "."])
def test_show_of_no_file_is_one_line(tmp_path, capsys, path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["show", path]) == 1
    err = capsys.readouterr().err  # (a traceback, for "" also in the series hint)
    assert "fdl show: error: cannot open checkpoint" in err and err.count("\n") == 1, err
