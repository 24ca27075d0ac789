"""Prompt assembly as pure functions of token ids: layouts and context positions checked with a few numbers."""
import pytest
import torch

from fewclip.adapters._prompts import assemble_prompts, packed_suffixes, shared_prefix_length

S, E, DOT = 100, 101, 5  # start, end and full-stop ids
NAMES = [[7], [8, 9]]  # a one-token and a two-token class name
CTX = [1, 2, 3, 4]  # four context slots (word init ids, or a placeholder repeated)


@pytest.mark.parametrize("position, tokens, positions", [
    ("end", [[S, 1, 2, 3, 4, 7, DOT, E], [S, 1, 2, 3, 4, 8, 9, DOT, E]], [[1, 2, 3, 4], [1, 2, 3, 4]]),
    ("middle", [[S, 1, 2, 7, 3, 4, DOT, E], [S, 1, 2, 8, 9, 3, 4, DOT, E]], [[1, 2, 4, 5], [1, 2, 5, 6]]),
    ("front", [[S, 7, 1, 2, 3, 4, DOT, E], [S, 8, 9, 1, 2, 3, 4, DOT, E]], [[2, 3, 4, 5], [3, 4, 5, 6]]),
])
def test_layout_by_hand(position, tokens, positions):
    layout = assemble_prompts(NAMES, CTX, position, start=[S], end=[E], suffix=[DOT])
    assert layout.tokens == tokens and layout.ctx_positions == positions
    for row, pos in zip(layout.tokens, layout.ctx_positions):
        assert [row[p] for p in pos] == CTX  # the context slots, in context order


@pytest.mark.parametrize("position", ["end", "middle", "front"])
def test_without_a_start_token_everything_moves_one_left(position):
    with_start = assemble_prompts(NAMES, CTX, position, start=[S], end=[E], suffix=[DOT])
    without = assemble_prompts(NAMES, CTX, position, start=[], end=[E], suffix=[DOT])
    assert without.tokens == [row[1:] for row in with_start.tokens]
    assert without.ctx_positions == [[p - 1 for p in pos] for pos in with_start.ctx_positions]


def test_odd_context_splits_with_the_smaller_half_first_and_no_suffix():
    layout = assemble_prompts([[7]], [1, 2, 3], "middle", start=[S], end=[E])
    assert layout.tokens == [[S, 1, 7, 2, 3, E]] and layout.ctx_positions == [[1, 3, 4]]


def test_bad_position_is_named():
    with pytest.raises(ValueError, match="'start'"):
        assemble_prompts(NAMES, CTX, "start", start=[S], end=[E])


def test_shared_prefix_length():
    assert [shared_prefix_length(4, p, n_start=1, csc=False) for p in ("end", "middle", "front")] == [5, 3, 1]
    assert [shared_prefix_length(4, p, n_start=0, csc=False) for p in ("end", "middle", "front")] == [4, 2, 0]
    assert shared_prefix_length(4, "end", n_start=1, csc=True) == 1  # class-specific context: start only


def test_packed_suffixes_by_hand():
    tokens = [[S, 1, 7, E], [S, 1, 8, 9, E]]  # prefix of 2 shared positions
    cls, pos, mask, pool = packed_suffixes(tokens, 2)
    assert cls.tolist() == [0, 0, 1, 1, 1] and pos.tolist() == [2, 3, 2, 3, 4]
    assert pool.tolist() == [1, 4]  # each prompt's last (end-of-text) token in the packing
    want = torch.tensor([
        # prefix  | packed: 7  E  8  9  E
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, want)
