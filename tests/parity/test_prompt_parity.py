"""CoOp, CoCoOp, KgCoOp, ProGrad and TCP equal their authors' code on the tiny CLIP: logits, losses, one step's
gradients and parameters (tests/fixtures/prompt_ref, computed by the authors' repositories; tests/prompt_parity.py
says what each check compares)."""
import pytest

from helpers.prompt_parity import ALL_FIXTURES, TOLERANCE, checks, max_diff, tiny_backbone


@pytest.fixture(scope="module")
def tiny():
    return tiny_backbone()


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_equals_the_authors_code(tiny, name):
    results = checks(tiny, name)
    assert len(results) >= 4
    worst = {what: max_diff(got, want) for what, got, want in results}
    bad = {what: d for what, d in worst.items() if not d <= TOLERANCE}
    assert not bad, f"{name}: differences from the authors' code above {TOLERANCE}: {bad}"
