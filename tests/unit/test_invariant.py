"""The invariant kernel: a prompt read in any split gives the bits of one stock pass over it."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag import KVEngine, MemoryStore
from kvrag.core.runner import ModelRunner, logits_sha256
from kvrag.kernels.attention import MIN_FORWARD_ROWS

from ..conftest import DOC_A, DOC_B, DOC_C, DTYPES, FAMILIES, QUESTION, tiny


def _one_stock_pass(model, ids):
    """What a user's own transformers code computes: one forward, no kvrag code in the way."""
    with torch.inference_mode():
        return model.hf_model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]


def _beyond_tokenizer(model):
    """Ids the model scores but the tokenizer cannot write: kvrag never picks them."""
    return list(range(len(model.tokenizer), model.hf_model.get_input_embeddings().num_embeddings)) or None


@st.composite
def split_prompts(draw):
    """A random prompt and random split points, some pieces only 1-9 tokens long."""
    length = draw(st.integers(20, 200))
    ids = draw(st.lists(st.integers(3, 255), min_size=length, max_size=length))
    cuts = set(draw(st.lists(st.integers(1, length - 1), min_size=1, max_size=4)))
    if draw(st.booleans()):  # a short tail, as a question after a grafted document
        cuts.add(length - draw(st.integers(1, 9)))
    if draw(st.booleans()):  # a short piece in the middle
        start = draw(st.integers(1, length - 10))
        cuts |= {start, start + draw(st.integers(1, 9))}
    return ids, sorted(cuts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=split_prompts())
def test_any_split_equals_one_stock_pass(family, dtype, prompt):
    ids, cuts = prompt
    model = tiny(family, dtype, "invariant")
    runner = ModelRunner(model)
    cache, start = runner.new_cache(), 0
    for end in [*cuts, len(ids)]:
        logits = runner.forward(ids[start:end], cache)
        start = end
    assert cache.get_seq_length() == len(ids)
    assert logits_sha256(logits) == logits_sha256(_one_stock_pass(model, ids))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_padded_read_leaves_the_cache_as_an_unpadded_one(family):
    """Short reads are padded to MIN_FORWARD_ROWS rows; the dummies leave no trace in the cache."""
    model = tiny(family, "float32", "invariant")
    runner = ModelRunner(model)
    ids = list(range(40, 140))
    padded, plain = runner.new_cache(), runner.new_cache()
    runner.forward(ids[:90], padded)
    runner.forward(ids[90:95], padded)  # 5 rows: padded
    runner.forward(ids[:95], plain)
    assert 95 - 90 < MIN_FORWARD_ROWS
    for a, b in zip(padded.layers, plain.layers):
        assert a.keys.shape == b.keys.shape
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a.get_seq_length() == b.get_seq_length() == 95


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_a_grafted_answer_is_the_answer_of_a_stock_generate(family):
    model = tiny(family, "float32", "invariant")
    engine = KVEngine(model, MemoryStore())
    refs = engine.deposit_chain([DOC_A, DOC_B])
    kv = engine.generate(QUESTION, states=refs, max_new_tokens=8, memo=False)
    assert kv.receipt.mode == "exact-graft"
    segments = engine.plan([DOC_A, DOC_B])
    ids = [i for s in segments for i in s.ids] + engine.planner.question(QUESTION, segments)
    with torch.inference_mode():
        out = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, eos_token_id=sorted(engine.layout.stop_ids),
                                      pad_token_id=0, suppress_tokens=_beyond_tokenizer(model))
    stock = [t for t in out.sequences[0, len(ids):].tolist() if t not in engine.layout.stop_ids]
    assert kv.tokens[: len(stock)] == stock
    assert kv.receipt.first_token_logits_sha256 == logits_sha256(out.logits[0][0])


def test_a_stock_model_can_load_the_kernel_by_name():
    from transformers import AutoModelForCausalLM

    from kvrag.kernels import make_linear_invariant, register

    register()  # what a model loaded by hand needs first
    model = tiny("llama", "float32", "invariant")
    stock = AutoModelForCausalLM.from_config(model.hf_model.config, attn_implementation="invariant")
    stock.load_state_dict(model.hf_model.state_dict())
    make_linear_invariant(stock)  # the linear layers: one call on a model loaded by hand
    ids = list(range(30, 90))
    with torch.inference_mode():
        a = stock.eval()(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    assert logits_sha256(a) == logits_sha256(_one_stock_pass(model, ids))


SYSTEM = {"role": "system", "content": "You answer from the documents given."}


def _prompt_ids(engine, messages):
    return engine.renderer.render([engine_message(m) for m in messages]).ids


def engine_message(m):
    from kvrag.core.transcript import Message

    return Message(**m)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_prompt_from_an_unseen_template_grafts_the_longest_stored_prefix(family):
    """Stored: one conversation's segments. Asked: a prompt that begins with the same tokens and
    then parts from them in the middle of a stored segment. The stored chain is grafted up to
    that token (its last state cut there), and the logits are those of one stock pass."""
    model = tiny(family, "float32", "invariant")
    engine = KVEngine(model, MemoryStore())
    stored = [SYSTEM, {"role": "user", "content": f"{DOC_A}\n{DOC_B}\nQuestion: {QUESTION}"}]
    engine.deposit_chat(stored)
    asked = [SYSTEM, {"role": "user", "content": f"{DOC_A}\n{DOC_B[:60]} (an edit) {DOC_B[60:]}\nBriefly: {QUESTION}"}]
    stored_ids = engine.renderer.render([engine_message(m) for m in stored], generation_prompt=False).ids
    ids = _prompt_ids(engine, asked)
    shared = next(i for i, (a, b) in enumerate(zip(stored_ids, ids)) if a != b)

    kv = engine.chat(asked, max_new_tokens=4)
    segments = engine.planner.chain(engine.renderer.render([engine_message(m) for m in asked]).pieces())
    whole_segments = sum(len(s.ids) for s in segments[:-1] if s.end <= shared)
    assert kv.receipt.tokens_reused == shared > whole_segments  # reuse ends inside a stored segment
    assert kv.receipt.mode == "partial-graft" and kv.receipt.exact
    assert any("longest stored prefix" in (u.detail or "") for u in kv.receipt.states)
    assert kv.receipt.first_token_logits_sha256 == logits_sha256(_one_stock_pass(model, ids))
    text = engine.chat(asked, max_new_tokens=4, graft=False)
    assert text.receipt.tokens_reused == 0 and text.tokens == kv.tokens


def test_a_sliding_window_model_reuses_whole_stored_states_only():
    model = tiny("gemma3", "float32", "invariant")
    engine = KVEngine(model, MemoryStore())
    stored = [SYSTEM, {"role": "user", "content": f"{DOC_A}\n{DOC_B}\nQuestion: {QUESTION}"}]
    engine.deposit_chat(stored)
    asked = [SYSTEM, {"role": "user", "content": f"{DOC_A}\n{DOC_B[:60]} (an edit) {DOC_B[60:]}\nBriefly: {QUESTION}"}]
    kv = engine.chat(asked, max_new_tokens=4)
    ids = _prompt_ids(engine, asked)
    assert kv.receipt.mode == "partial-graft"
    assert all(u.detail is None or "longest stored prefix" not in u.detail for u in kv.receipt.states)
    assert kv.receipt.first_token_logits_sha256 == logits_sha256(_one_stock_pass(model, ids))


def test_forged_prefix_records_graft_nothing():
    """A record is a hint: pointing it at a state whose verified tokens differ grafts only the
    tokens they share (here the chat template's opening), never the rest."""
    from kvrag.core.prefixes import prefix_marks

    model = tiny("llama", "float32", "invariant")
    engine = KVEngine(model, MemoryStore())
    other = engine.deposit_chain([DOC_C])[0]
    asked = [SYSTEM, {"role": "user", "content": f"{DOC_A}\n{DOC_B}\nQuestion: {QUESTION}"}]
    ids = _prompt_ids(engine, asked)
    for _, name in prefix_marks(engine.identity.scope, ids):  # signed with the engine's own key: only the hint lies
        engine.records.put(name, f'{{"key": "{other.key}"}}'.encode())
    kv = engine.chat(asked, max_new_tokens=4)
    other_ids = engine.plan([DOC_C])[0].ids
    shared = next(i for i, (a, b) in enumerate(zip(other_ids, ids)) if a != b)
    assert shared < 30 and kv.receipt.tokens_reused == shared
    assert kv.receipt.first_token_logits_sha256 == logits_sha256(_one_stock_pass(model, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(576, 576), (576, 192), (576, 1536), (1536, 576), (640, 1024), (640, 256),
                                  (1024, 640), (640, 2048), (2048, 640), (64, 128), (128, 64), (576, 49152),
                                  (3000, 100), (4096, 64)])
def test_an_invariant_linear_row_has_the_same_bits_read_alone_or_among_many(k, n, dtype):
    """The widths of smollm2-135m, gemma3-270m and the tiny models: a row read alone or among a
    few (a question's rows, a decoding step) equals the same row inside a long call."""
    from kvrag.kernels.linear import make_linear_invariant

    torch.manual_seed(k + n)
    layer = make_linear_invariant(torch.nn.Sequential(torch.nn.Linear(k, n, dtype=dtype)))
    x = torch.randn(1, 600, k, dtype=dtype)
    with torch.inference_mode():
        whole = layer(x)
        for start, rows in ((598, 1), (597, 2), (595, 3), (580, 4), (590, 5), (500, 11), (300, 16), (17, 40), (0, 300)):
            part = layer(x[:, start : start + rows].contiguous())
            assert torch.equal(part, whole[:, start : start + rows]), (start, rows)


def test_a_float32_decoding_step_runs_kvrags_operator_and_few_rows_are_not_padded_to_a_block():
    """One float32 row is computed by kvrag's own operator, and a short call is fed only as many
    rows as keep its bits (the row test above checks the bits); where the operator cannot run, the
    layer says why and pads."""
    from kvrag.kernels import linear, native
    from kvrag.kernels.linear import ROW_BLOCK, make_linear_invariant

    fed: list[int] = []
    for dtype in (torch.float32, torch.bfloat16):
        layer = make_linear_invariant(torch.nn.Sequential(torch.nn.Linear(1536, 576, dtype=dtype)))[0].forward.forward
        in_float32 = dtype == torch.float32 or linear.linear_kernel(dtype) == "onednn-f32"
        assert (layer._made.native is not None) == (in_float32 and native.available()[0])
        fewest = linear.fewest_rows(layer._made.packed, 576, 1536, torch.float32 if in_float32 else dtype, None)
        assert fewest < ROW_BLOCK // 2
        fed.append(fewest)
    if not native.available()[0]:
        pytest.skip(f"kvrag's operator is not available here: {native.available()[1]}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_every_decoded_token_has_the_logits_of_one_stock_pass_over_the_text_so_far(family, dtype):
    model = tiny(family, dtype, "invariant")
    runner = ModelRunner(model)
    ids = list(range(30, 130))
    cache = runner.new_cache()
    logits = runner.forward(ids, cache)
    for _ in range(6):
        ids.append(int(torch.argmax(logits)))
        logits = runner.step(ids[-1], cache)
        assert logits_sha256(logits) == logits_sha256(_one_stock_pass(model, ids)), len(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_invariant_linear_layer_follows_its_weight_and_bias_when_they_change(dtype):
    """The reordered weight (and the bias in the dtype oneDNN computes in) are made again when the
    layer's weight or bias changes in place or is loaded anew, so a layer never computes with a
    stale copy."""
    from kvrag.kernels.linear import make_linear_invariant

    torch.manual_seed(0)
    model = make_linear_invariant(torch.nn.Sequential(torch.nn.Linear(64, 32, dtype=dtype)))
    x = torch.randn(20, 64, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    with torch.inference_mode():
        before = model(x)
    with torch.no_grad():
        model[0].weight.mul_(2)
        model[0].bias.zero_()
    with torch.inference_mode():
        assert torch.allclose(model(x), torch.nn.functional.linear(x, model[0].weight), atol=tolerance)
    with torch.no_grad():
        model[0].bias.fill_(3)
    with torch.inference_mode():
        assert torch.allclose(model(x), torch.nn.functional.linear(x, model[0].weight) + 3, atol=tolerance)
    model.load_state_dict({"0.weight": torch.zeros(32, 64, dtype=dtype), "0.bias": torch.ones(32, dtype=dtype)})
    with torch.inference_mode():
        assert torch.equal(model(x), torch.ones(20, 32, dtype=dtype)) and not torch.equal(model(x), before)


def test_an_invariant_model_can_be_copied_and_pickled_and_computes_the_same_bits():
    import copy
    import pickle

    model = tiny("llama", "float32", "invariant").hf_model
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(other(input_ids=ids).logits, expected)


def test_a_model_made_under_inference_mode_can_be_made_invariant():
    """Inference tensors keep no version counter; their layers are made invariant all the same."""
    from kvrag.kernels.linear import make_linear_invariant

    with torch.inference_mode():
        stock = torch.nn.Sequential(torch.nn.Linear(64, 32))
        x = torch.randn(20, 64)
        expected = stock(x)
        model = make_linear_invariant(stock)
        assert torch.allclose(model(x), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 256), (4, 2, 16), (34, 2, 16)])
def test_an_attention_row_has_the_same_bits_however_the_prompt_is_split(heads, kv_heads, head_dim, dtype):
    """One call over 1,100 positions against the same positions read as a document, a chain of
    parts and short questions after it, each part attending to the keys before it."""
    from kvrag.kernels.attention import invariant_attention

    torch.manual_seed(heads + head_dim)
    length = 1100
    q = torch.randn(1, heads, length, head_dim, dtype=dtype)
    k = torch.randn(1, kv_heads, length, head_dim, dtype=dtype)
    v = torch.randn(1, kv_heads, length, head_dim, dtype=dtype)

    def attend(start, end):
        positions = torch.arange(start, end)[None]
        out, _ = invariant_attention(None, q[:, :, start:end], k[:, :, :end], v[:, :, :end], None,
                                     position_ids=positions)
        return out

    whole = attend(0, length)
    for start, end in ((0, 490), (490, 1011), (1011, 1020), (1020, 1021), (1021, 1100), (37, 64), (64, 65),
                       (100, 117), (117, 137), (137, 170), (170, 220), (220, 285), (285, 318), (318, 530)):
        assert torch.equal(attend(start, end), whole[:, start:end]), (start, end)


def test_no_query_block_of_the_flash_kernel_is_short():
    """The flash kernel splits rows into blocks of 32, 64 or 256; a block of 1-3 rows rounds
    otherwise, so a chunk is computed as a row count whose every block holds MIN_QUERY_ROWS or more."""
    from kvrag.kernels.attention import MIN_QUERY_ROWS, QUERY_CHUNK, query_rows

    for rows in range(1, QUERY_CHUNK + 1):
        computed = query_rows(rows)
        assert rows <= computed < rows + MIN_QUERY_ROWS and computed >= MIN_QUERY_ROWS, rows
        assert all(computed % block == 0 or computed % block >= MIN_QUERY_ROWS for block in (32, 64, 256)), rows


def test_reads_after_a_graft_append_in_place_and_never_write_the_grafted_tensors():
    """Under the invariant kernel a full-attention layer grows inside a buffer of whole key blocks:
    decoding steps write no copy of the layer, the grafted (stored) tensors are never written, and
    the logits are one stock pass's."""
    from kvrag.codecs import StatePart, extract, install

    model = tiny("llama", "float32", "invariant")
    runner = ModelRunner(model)
    ids = [(i * 7) % 250 + 3 for i in range(200)]
    reader = runner.new_cache()
    runner.forward(ids[:150], reader)
    entries, tensors = extract(runner.codecs, reader, 0, 150)
    kept = {name: tensor.clone() for name, tensor in tensors.items()}
    cache = runner.new_cache()
    install(runner.codecs, cache, [StatePart(0, 150, entries, tensors)], runner.device)
    logits = runner.forward(ids[150:199], cache)
    assert logits_sha256(logits) == logits_sha256(_one_stock_pass(model, ids[:199]))
    where = [layer.keys.data_ptr() for layer in cache.layers]
    logits = runner.step(ids[199], cache)
    assert [layer.keys.data_ptr() for layer in cache.layers] == where  # appended in place
    assert logits_sha256(logits) == logits_sha256(_one_stock_pass(model, ids))
    assert all(torch.equal(tensors[name], kept[name]) for name in tensors)


def test_attention_logit_soft_capping_is_refused_with_a_clear_error():
    """Gemma 2's soft-capping has no place in the flash kernel the invariant kernel calls."""
    from kvrag.errors import ModelError
    from kvrag.kernels.attention import invariant_attention

    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ModelError, match="attn='sdpa'"):
        invariant_attention(None, q, q, q, None, softcap=50.0)


def test_what_every_layer_does_alike_is_made_once_per_forward(monkeypatch):
    """The mask, key spans and additive masks of a read after a graft are made once for all the
    layers of its forward (and again for the next forward), with the same logits."""
    import kvrag.kernels.attention as attention

    model = tiny("llama", "float32", "invariant")
    runner = ModelRunner(model)
    ids = [(i * 11) % 250 + 3 for i in range(140)]
    cache = runner.new_cache()
    runner.forward(ids[:100], cache)
    made = []
    real = attention._Plan
    monkeypatch.setattr(attention, "_Plan", lambda *a: made.append(1) or real(*a))
    logits = runner.forward(ids[100:130], cache)
    assert len(made) == 1 and model.hf_model.config.num_hidden_layers > 1
    runner.forward(ids[130:140], cache)
    assert len(made) == 2
    assert logits_sha256(logits) == logits_sha256(_one_stock_pass(model, ids[:130]))


def test_importing_kvrag_registers_nothing_with_transformers():
    import subprocess
    import sys

    code = ("import kvrag, kvrag.kernels, kvrag.engine\n"
            "from transformers import AttentionInterface\n"
            "assert 'invariant' not in AttentionInterface._global_mapping, 'registered at import'\n"
            "kvrag.kernels.register()\n"
            "assert 'invariant' in AttentionInterface._global_mapping\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_bfloat16_below_amx_unless_the_user_lets_onednn_use_it_and_then_another_fingerprint():
    """oneDNN's AMX products are not row-invariant: kvrag caps oneDNN below AMX at import, and a
    process whose user lifted the cap names another arithmetic (its states are never found by ours)."""
    import os
    import subprocess
    import sys

    from kvrag.kernels.linear import ISA_CAP, _cpu_has_amx, linear_kernel

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == ISA_CAP  # the suite sets none of its own
    assert linear_kernel(torch.float32) == "onednn"
    expected = ("onednn-capped",) if _cpu_has_amx() else ("onednn", "onednn-f32", "stock")
    assert linear_kernel(torch.bfloat16) in expected
    probe = ("import torch; from kvrag.kernels.linear import linear_kernel; "
             "from kvrag.models.fingerprints import kernel_name; print(kernel_name('invariant', torch.bfloat16))")
    names = {cap: subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                 env={**os.environ, "ONEDNN_MAX_CPU_ISA": cap}).stdout.split()[-1]
             for cap in (ISA_CAP, "ALL")}
    if _cpu_has_amx():
        assert names == {ISA_CAP: "invariant/3-onednn-capped", "ALL": "invariant/3-onednn-amx"}
    else:
        assert names[ISA_CAP] == names["ALL"]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_the_kernel_reads_a_caches_key_value_buffers_as_they_lie_and_their_rows_past_the_view_are_finite(
        family, monkeypatch):
    """A cache's K/V are views carrying their whole-block buffer (no registry by address): the kernel
    pads none of them by copying, after short padded reads and decoding steps, and the buffer's rows
    past a view, which it reads masked, are finite (zeros, or a padded read's dropped rows)."""
    from kvrag.kernels import attention

    model = tiny(family, "float32", "invariant")
    runner = ModelRunner(model)
    found: list[tuple[int, bool]] = []
    attend = attention._attention

    def watched(module, query, key, value, *args):
        found.append((module.layer_idx, attention.buffer_of(key) is not None and attention.buffer_of(value) is not None))
        return attend(module, query, key, value, *args)

    monkeypatch.setattr(attention, "_attention", watched)
    cache = runner.new_cache()
    ids = list(range(40, 140))
    runner.forward(ids[:90], cache)
    first = [attention.buffer_of(layer.keys) for layer in cache.layers]
    runner.forward(ids[90:95], cache)  # padded, its dummies dropped
    for token in ids[95:98]:
        runner.step(token, cache)
    full = {i for i, layer in enumerate(cache.layers) if type(layer).__name__ == "DynamicLayer"}
    assert full and len(found) == 5 * len(cache.layers)
    assert [i for i, kept in found if i in full and not kept] == [], "K/V read as padded copies"
    for i, layer in enumerate(cache.layers):
        if i not in full:
            continue  # a sliding window's layer keeps its own tensors
        for states in (layer.keys, layer.values):
            buffer = attention.buffer_of(states)
            assert buffer is not None and states.shape[-2] == 98
            assert states is layer.values or buffer is first[i]  # one block: written in place, never copied
            assert torch.isfinite(buffer[:, :, 98:]).all()


@pytest.mark.parametrize("k, n", [(640, 1024), (3000, 100), (4096, 64), (576, 1536)])
def test_a_bfloat16_layer_computed_in_float32_has_each_row_the_same_bits_and_rounds_oneDNNs_float32(k, n, monkeypatch):
    """On a CPU without AVX512-BF16 (`onednn-f32`, whichever CPU runs this test), a bfloat16 layer is
    oneDNN's float32 product over the same values, rounded to bfloat16: a row has the same bits
    read alone or among many."""
    from kvrag.kernels import linear
    from kvrag.kernels.linear import make_linear_invariant

    linear._cpu_has.cache_clear()
    linear.linear_kernel.cache_clear()
    monkeypatch.setattr(linear, "_cpu_has", lambda flag: False)
    try:
        assert linear.linear_kernel(torch.bfloat16) == "onednn-f32"
        torch.manual_seed(k + n)
        module = torch.nn.Linear(k, n, dtype=torch.bfloat16)
        layer = make_linear_invariant(torch.nn.Sequential(module))
        x = torch.randn(1, 600, k, dtype=torch.bfloat16)
        with torch.inference_mode():
            whole = layer(x)
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.float(), None)
            in_float32 = torch.ops.mkldnn._linear_pointwise(x[0].float(), packed, module.bias.float(), "none", [], "")
            assert whole.dtype == torch.bfloat16 and torch.equal(whole[0], in_float32.to(torch.bfloat16))
            for start, rows in ((598, 1), (597, 2), (595, 3), (580, 4), (590, 5), (500, 11), (300, 16), (0, 300)):
                assert torch.equal(layer(x[:, start : start + rows].contiguous()), whole[:, start : start + rows]), (start, rows)
    finally:
        monkeypatch.undo()
        linear.linear_kernel.cache_clear()
