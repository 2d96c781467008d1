"""The reshard planner: trainer ranks send exactly the slices workers need, and a worker's model is all or nothing."""

import dataclasses
import random

import pytest
import torch

from heterorl.transport.weights.reshard import (
    Assembler,
    DestLayout,
    Piece,
    Placement,
    ReshardError,
    SourceLayout,
    box_of,
    box_slices,
    chunk_bounds,
    even_bounds,
    intersect,
    local,
    plan,
    take,
    volume,
)

ROWS_8x8 = {"w": (8, 8)}


def source_locals(full: dict[str, torch.Tensor], source: SourceLayout) -> list[dict[str, torch.Tensor]]:
    """Each trainer rank's local tensors, cut from the full ones by its boxes."""
    return [{name: tensor[box_slices(source.box(name, tuple(tensor.shape), rank))].clone()
             for name, tensor in full.items()} for rank in range(source.world)]


def assemble(pieces: list[Piece], locals_: list[dict], version: int, shapes: dict, layout: DestLayout,
             dest: str) -> Assembler:
    assembler = Assembler(version, shapes, layout, torch.float64, dest=dest)
    for piece in pieces:
        assembler.add(version, piece, take(locals_[piece.src_rank][piece.name], piece))
    return assembler


def columns_8x8() -> tuple[dict, SourceLayout, dict[str, DestLayout]]:
    full = {"w": torch.arange(64, dtype=torch.float64).reshape(8, 8)}
    dests = {f"w{j}": DestLayout({"w": (Placement.shard(1, 4), j)}) for j in range(4)}
    return full, SourceLayout.fsdp(ROWS_8x8, 2), dests


def test_rows_over_two_ranks_to_columns_over_four_workers():
    full, source, dests = columns_8x8()
    the_plan = plan(ROWS_8x8, source, dests)
    locals_ = source_locals(full, source)
    for j in range(4):
        cols = (2 * j, 2 * j + 2)
        assert the_plan.pieces_for(f"w{j}") == [
            Piece("w", 0, f"w{j}", ((0, 4), cols), ((0, 4), cols), ((0, 4), (0, 2)), (4, 8)),
            Piece("w", 1, f"w{j}", ((4, 8), cols), ((0, 4), cols), ((4, 8), (0, 2)), (4, 8)),
        ]
        assembler = assemble(the_plan.pieces_for(f"w{j}"), locals_, 3, ROWS_8x8, dests[f"w{j}"], f"w{j}")
        assert assembler.complete
        assert torch.equal(assembler.tensors()["w"], full["w"][:, 2 * j:2 * j + 2])
    assert len(the_plan.pieces) == 8
    assert sorted(the_plan.pieces_from(1)) == ["w0", "w1", "w2", "w3"]
    assert the_plan.bytes_from(0, 4) == the_plan.bytes_from(1, 4) == 32 * 4  # each rank sends its 4x8 rows once
    assert the_plan.bytes_for("w2", {"w": 2}) == 16 * 2


def test_bounds_by_hand():
    assert [chunk_bounds(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [chunk_bounds(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]  # ranks 2, 3 own nothing
    assert [len(c) for c in torch.arange(10).chunk(4)] == [3, 3, 3, 1]
    assert [even_bounds(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ReshardError, match="size 10.*4 equal parts"):
        even_bounds(10, 4, 0)
    assert box_of((6, 5), Placement.shard(1, 5), 3, even=True) == ((0, 6), (3, 4))
    assert box_of((6, 5), Placement.replicate(), 3, even=True) == ((0, 6), (0, 5))
    assert intersect(((0, 4), (2, 6)), ((3, 8), (0, 3))) == ((3, 4), (2, 3))
    assert intersect(((0, 4),), ((4, 8),)) is None
    assert local(((3, 4), (2, 3)), ((2, 6), (0, 3))) == ((1, 2), (2, 3))


def test_a_replicated_source_spreads_each_workers_tensor_over_every_rank():
    shapes = {"w": (8, 4), "scalar": ()}
    full = {"w": torch.randn(8, 4, dtype=torch.float64), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    source = SourceLayout.replicated(shapes, 4)
    the_plan = plan(shapes, source, {"all": DestLayout()})
    assert [(p.src_rank, p.global_box) for p in the_plan.pieces_for("all") if p.name == "w"] == [
        (rank, ((2 * rank, 2 * rank + 2), (0, 4))) for rank in range(4)]
    assert {the_plan.bytes_from(rank, {"w": 8, "scalar": 0}) for rank in range(4)} == {2 * 4 * 8}
    assembler = assemble(the_plan.pieces_for("all"), source_locals(full, source), 0, shapes, DestLayout(), "all")
    assert all(torch.equal(assembler.tensors()[name], full[name]) for name in shapes)


def random_case(rng: random.Random) -> tuple[dict, SourceLayout, dict[str, DestLayout]]:
    """Small tensors of 0-3 dims (sizes often not divisible by the world, sometimes below it, sometimes 0), a
    random trainer layout and 1-4 workers with random layouts that divide evenly."""
    world = rng.randint(1, 4)
    shapes, sources = {}, {}
    for t in range(rng.randint(1, 4)):
        ndim = rng.choice([0, 1, 1, 2, 2, 3])
        shape = tuple(rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8]) if rng.random() < 0.1 else rng.randint(1, 8)
                      for _ in range(ndim))
        shapes[f"t{t}"] = shape
        shard = ndim and rng.random() < 0.6
        sources[f"t{t}"] = Placement.shard(rng.randrange(ndim), world) if shard else Placement.replicate()
    dests = {}
    for w in range(rng.randint(1, 4)):
        placements = {}
        for name, shape in shapes.items():
            if shape and rng.random() < 0.7:
                dim = rng.randrange(len(shape))
                parts = rng.choice([p for p in range(1, 5) if shape[dim] % p == 0])
                placements[name] = (Placement.shard(dim, parts), rng.randrange(parts))
        dests[f"worker{w}"] = DestLayout(placements)
    return shapes, SourceLayout(world, sources), dests


def test_random_layouts_cover_every_element_exactly_once_and_assemble_the_right_slices():
    rng = random.Random(1234)
    spread_checked = pieces_seen = 0
    for case in range(300):
        shapes, source, dests = random_case(rng)
        full = {name: torch.randn(shape, dtype=torch.float64) for name, shape in shapes.items()}
        locals_ = source_locals(full, source)
        the_plan = plan(shapes, source, dests)
        for dest, layout in dests.items():
            pieces = the_plan.pieces_for(dest)
            pieces_seen += len(pieces)
            for name, shape in shapes.items():
                box = layout.box(name, shape)
                cover = torch.zeros([stop - start for start, stop in box], dtype=torch.int64)
                for piece in (p for p in pieces if p.name == name):
                    assert intersect(piece.global_box, box) == piece.global_box, (case, piece)
                    cover[box_slices(piece.dst_box)] += 1
                assert bool((cover == 1).all()), (case, dest, name, cover)
                extent = max((stop - start for start, stop in box), default=0)
                if source.placements[name].kind == "replicate" and volume(box) and extent >= source.world > 1:
                    # rank r sends chunk r of the largest dim; with chunk semantics the last ranks may send nothing
                    ranks = {p.src_rank for p in pieces if p.name == name}
                    chunk = -(-extent // source.world)
                    assert ranks == set(range(-(-extent // chunk))) and len(ranks) > 1, (case, name, ranks)
                    spread_checked += 1
            rng.shuffle(pieces)
            assembler = assemble(pieces, locals_, case, shapes, layout, dest)
            assert assembler.complete and assembler.missing() == 0
            for name, tensor in assembler.tensors().items():
                assert torch.equal(tensor, full[name][box_slices(layout.box(name, shapes[name]))]), (case, name)
        sent = sum(the_plan.bytes_from(rank, 8) for rank in range(source.world))
        assert sent == sum(the_plan.bytes_for(dest, 8) for dest in dests)
    assert spread_checked > 50 and pieces_seen > 1000  # the interesting cases did occur


def test_plan_is_deterministic_whatever_the_dicts_order():
    rng = random.Random(7)
    for _ in range(20):
        shapes, source, dests = random_case(rng)
        first = plan(shapes, source, dests)
        assert plan(shapes, source, dests) == first
        shuffled = dict(reversed(list(shapes.items())))
        assert plan(shuffled, source, dict(reversed(list(dests.items())))) == first


@pytest.mark.parametrize("placement, index, words", [
    (Placement.shard(1, 3), 0, ["'w'", "dim 1", "size 8", "3 equal parts", "replicate"]),
    (Placement.shard(2, 2), 0, ["'w'", "no dim 2", "(4, 8)", "2 parts"]),
    (Placement.shard(0, 2), 2, ["'w'", "dim 0", "index 2", "0..1"]),
])
def test_a_worker_layout_that_cannot_be_honoured_is_refused_naming_tensor_dim_size_parts(placement, index, words):
    layout = DestLayout({"w": (placement, index)})
    with pytest.raises(ReshardError) as refused:
        layout.validate({"w": (4, 8)})
    assert all(word in str(refused.value) for word in words), str(refused.value)
    with pytest.raises(ReshardError, match="worker 'tp0'"):
        plan({"w": (4, 8)}, SourceLayout.fsdp({"w": (4, 8)}, 2), {"tp0": layout})


def test_layouts_that_do_not_match_the_model_are_refused():
    with pytest.raises(ReshardError, match="'ghost'"):
        DestLayout({"ghost": (Placement.shard(0, 2), 0)}).validate({"w": (4, 8)})
    with pytest.raises(ReshardError, match="no placement for \\['b'\\]"):
        plan({"a": (4,), "b": (4,)}, SourceLayout(2, {"a": Placement.shard(0, 2)}), {})
    with pytest.raises(ReshardError, match="3 parts over 2 ranks"):
        plan({"a": (4,)}, SourceLayout(2, {"a": Placement.shard(0, 3)}), {})


def test_take_refuses_a_local_tensor_that_is_not_the_planned_shard():
    full, source, dests = columns_8x8()
    piece = plan(ROWS_8x8, source, dests).pieces_for("w1")[1]
    assert torch.equal(take(full["w"][4:], piece), full["w"][4:, 2:4]) and take(full["w"][4:], piece).is_contiguous()
    with pytest.raises(ReshardError, match="source rank 1.*\\(8, 8\\).*\\(4, 8\\)") as refused:
        take(full["w"], piece)
    assert refused.value.reason == "shape"


def refused_reason(assembler: Assembler, version: int, piece: Piece, data: torch.Tensor) -> str:
    before = assembler.missing()
    with pytest.raises(ReshardError) as refused:
        assembler.add(version, piece, data)
    assert assembler.missing() == before  # a refused piece changes nothing
    return refused.value.reason


def test_the_assembler_refuses_every_piece_that_does_not_fit_exactly():
    full, source, dests = columns_8x8()
    piece0, piece1 = plan(ROWS_8x8, source, dests).pieces_for("w1")
    data0 = full["w"][0:4, 2:4].clone()
    assembler = Assembler(5, ROWS_8x8, dests["w1"], torch.float64, dest="w1")
    assert refused_reason(assembler, 4, piece0, data0) == "version"
    assert refused_reason(assembler, 5, Piece("bias", 0, "w1", ((0, 4),), ((0, 4),), ((0, 4),), (4,)),
                          data0[0]) == "unknown_tensor"
    assert refused_reason(assembler, 5, piece0, data0[:3]) == "shape"
    assert refused_reason(assembler, 5, piece0, data0.float()) == "dtype"
    outside = Piece("w", 1, "w1", ((4, 8), (2, 4)), ((0, 4), (2, 4)), ((6, 10), (0, 2)), (4, 8))
    assert refused_reason(assembler, 5, outside, data0) == "offset"
    assert refused_reason(assembler, 5, dataclasses.replace(piece0, dest="w2"), data0) == "dest"
    assembler.add(5, piece0, data0)
    assert assembler.missing() == 8 and assembler.missing("w") == 8 and not assembler.complete
    assert refused_reason(assembler, 5, piece0, data0) == "duplicate"
    overlapping = Piece("w", 1, "w1", ((3, 7), (2, 4)), ((0, 4), (2, 4)), ((3, 7), (0, 2)), (4, 8))
    assert refused_reason(assembler, 5, overlapping, data0) == "duplicate"
    assembler.add(5, piece1, full["w"][4:8, 2:4].clone())
    assert assembler.complete and torch.equal(assembler.tensors()["w"], full["w"][:, 2:4])


def test_an_incomplete_model_is_never_handed_out():
    shapes = {"emb": (6, 4), "head": (4, 6)}
    source = SourceLayout.fsdp(shapes, 2)
    full = {name: torch.randn(shape, dtype=torch.float64) for name, shape in shapes.items()}
    pieces = plan(shapes, source, {"all": DestLayout()}).pieces_for("all")
    locals_ = source_locals(full, source)
    assembler = assemble([p for p in pieces if p.src_rank == 0 or p.name == "emb"], locals_, 1, shapes,
                         DestLayout(), "all")
    assert assembler.missing("emb") == 0 and assembler.missing("head") == 12 and assembler.missing() == 12
    with pytest.raises(ReshardError, match="'head' \\(12 of 24 elements\\)") as refused:
        assembler.tensors()
    assert refused.value.reason == "incomplete" and "'emb'" not in str(refused.value)
    assert Assembler(1, {"empty": (0, 3)}, DestLayout(), torch.float32).complete  # nothing to wait for


@pytest.mark.parametrize("garbage", [
    "shard", None, {}, {"kind": "diagonal"}, {"kind": "shard", "dim": -1, "parts": 2},
    {"kind": "shard", "dim": 0, "parts": 0}, {"kind": "shard", "dim": "0", "parts": 2},
    {"kind": "shard", "dim": True, "parts": 2}, {"kind": "replicate", "parts": 2},
    {"kind": "shard", "dim": 0, "parts": 2, "mesh": "tp"},
])
def test_placement_from_dict_refuses_garbage(garbage):
    with pytest.raises(ReshardError) as refused:
        Placement.from_dict(garbage)
    assert refused.value.reason == "placement"


def test_layouts_round_trip_through_plain_dicts():
    for placement in (Placement.replicate(), Placement.shard(2, 4)):
        assert Placement.from_dict(placement.to_dict()) == placement
    layout = DestLayout({"w": (Placement.shard(1, 4), 3), "b": (Placement.replicate(), 0)})
    assert DestLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ReshardError, match="index '1' is not an int"):
        DestLayout.from_dict({"w": {"kind": "shard", "dim": 0, "parts": 2, "index": "1"}})
    assert volume(((0, 2), (1, 4))) == 6 and volume(()) == 1


LLAMA_LAYER = {"model.embed_tokens.weight": (20, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
               "model.layers.0.self_attn.q_proj.bias": (8,), "model.layers.0.self_attn.o_proj.weight": (8, 8),
               "model.layers.0.mlp.up_proj.weight": (12, 8), "model.layers.0.mlp.down_proj.weight": (8, 12),
               "model.layers.0.input_layernorm.weight": (8,), "lm_head.weight": (20, 8)}


def test_a_tensor_parallel_engines_ranks_split_projections_megatron_style_and_together_hold_the_model():
    ranks = [DestLayout.tensor_parallel(LLAMA_LAYER, r, 2) for r in range(2)]
    assert ranks[1].box("model.layers.0.self_attn.q_proj.weight", (8, 8)) == ((4, 8), (0, 8))  # output rows
    assert ranks[1].box("model.layers.0.self_attn.q_proj.bias", (8,)) == ((4, 8),)
    assert ranks[0].box("model.layers.0.mlp.down_proj.weight", (8, 12)) == ((0, 8), (0, 6))  # input columns
    assert ranks[0].placement("model.layers.0.input_layernorm.weight") == (Placement.replicate(), 0)
    assert ranks[0].placement("lm_head.weight") == (Placement.replicate(), 0)  # the vocabulary whole by default
    vocab = DestLayout.tensor_parallel(LLAMA_LAYER, 1, 2, shard_vocab=True)
    assert vocab.box("model.embed_tokens.weight", (20, 8)) == ((10, 20), (0, 8))
    assert DestLayout.tensor_parallel(LLAMA_LAYER, 0, 1) == DestLayout()  # one rank: the whole model
    # every rank's slices, from 3 FSDP ranks, cover each tensor's part exactly once (the planner's contract)
    pieces = plan(LLAMA_LAYER, SourceLayout.fsdp(LLAMA_LAYER, 3), {f"tp{r}": ranks[r] for r in range(2)})
    for r in range(2):
        for name, shape in LLAMA_LAYER.items():
            got = sum(volume(p.global_box) for p in pieces.pieces_for(f"tp{r}") if p.name == name)
            assert got == volume(ranks[r].box(name, shape)), name


def test_a_tensor_parallel_size_that_does_not_divide_the_model_is_refused():
    with pytest.raises(ReshardError, match="down_proj.weight. dim 1 has size 12.*5 equal parts"):
        DestLayout.tensor_parallel(LLAMA_LAYER, 0, 5)
    with pytest.raises(ReshardError, match="lm_head.weight. dim 0 has size 20.*3 equal parts"):
        DestLayout.tensor_parallel(LLAMA_LAYER, 0, 3, shard_vocab=True)
    with pytest.raises(ReshardError, match="0 <= rank < size"):
        DestLayout.tensor_parallel(LLAMA_LAYER, 2, 2)
