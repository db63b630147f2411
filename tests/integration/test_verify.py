"""The paper's table on CPU: 50 byte-exact samples per tiny family, dtype and attention kernel."""

import json

import pytest
from typer.testing import CliRunner

from kvrag.apps.verify import verify_model
from kvrag.cli import app

from ..conftest import ATTNS, DTYPES, FAMILIES, tiny


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_verify_is_byte_exact(family, dtype, attn):
    report = verify_model(tiny(family, dtype, attn), samples=50)
    assert report.samples == 50
    assert report.byte_exact == 50
    assert report.kl_max == 0.0
    assert report.argmax_agreement == 1.0
    assert report.fallback_byte_exact == 50
    assert report.monolithic.samples == 50  # measured, never asserted exact
    assert report.prompt_tokens_max > 32  # longer than gemma3's sliding window
    # Chains deposited on grafted ancestors hold the bytes of a from-scratch computation.
    assert report.chain_states == 15 and report.chain_states_byte_exact == 15


def test_verify_cli_prints_one_json_object():
    result = CliRunner().invoke(app, ["verify", "--model", "tiny-random-gemma3", "--samples", "5", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for field in ("samples", "byte_exact", "kl_max", "argmax_agreement", "monolithic", "model_fingerprint", "hardware_fingerprint"):
        assert field in data
    assert data["byte_exact"] == 5 and set(data["monolithic"]) >= {"byte_exact", "kl_max", "argmax_agreement"}


def test_verify_cli_prints_a_table_without_json():
    result = CliRunner().invoke(app, ["verify", "--model", "tiny-random-llama", "--samples", "3"])
    assert result.exit_code == 0, result.output
    assert "byte-exact" in result.stdout and "3/3" in result.stdout and "monolithic" in result.stdout
