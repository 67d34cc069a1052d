"""Exercise 10's check accepts the per-tensor count and names the usual wrong ones (work in progress)."""

from checking import fails, passes

from course_lib.tooling.checks import ch10  # noqa: F401  (registers the check)


def block_saved_bytes(batch, seq, n_embd, n_head, precision):
    f, p = 4, (2 if precision == "bf16" else 4)
    btc, bt = batch * seq * n_embd, batch * seq
    saved = (2 * f + 14 * p) * btc + 2 * 2 * bt * 4 + batch * n_head * seq * 4
    copies = 12 * n_embd * n_embd * 2 if p == 2 else 0
    return saved + copies


def test_the_per_tensor_count_passes():
    passes("10.block_saved_bytes", block_saved_bytes, times=2)


def test_forgetting_the_weight_copies_is_named():
    def no_copies(batch, seq, n_embd, n_head, precision):
        return block_saved_bytes(batch, seq, n_embd, n_head, precision) - (
            12 * n_embd * n_embd * 2 if precision == "bf16" else 0
        )

    for seed in range(4):
        assert "16-bit weight copies" in fails("10.block_saved_bytes", no_copies, seed=seed)


def test_counting_the_weights_as_new_memory_is_named():
    def with_weights(batch, seq, n_embd, n_head, precision):
        return (
            block_saved_bytes(batch, seq, n_embd, n_head, precision)
            + 4 * 12 * n_embd * n_embd
            - (2 * 12 * n_embd * n_embd if precision == "bf16" else 0)
        )

    assert "fp32 weights are counted" in fails("10.block_saved_bytes", with_weights, seed=2)


def test_16_bit_layernorm_inputs_are_named():
    def ln16(batch, seq, n_embd, n_head, precision):
        low = 2 if precision == "bf16" else 4
        return block_saved_bytes(batch, seq, n_embd, n_head, precision) - 2 * (4 - low) * batch * seq * n_embd

    for seed in range(4):
        assert "LayerNorm inputs (the residual stream) stay fp32" in fails("10.block_saved_bytes", ln16, seed=seed)


def test_a_hard_coded_number_and_a_string_fail():
    assert "the block saved" in fails("10.block_saved_bytes", lambda *a: 123456)
    assert "not a number" in fails("10.block_saved_bytes", lambda *a: "lots")
