"""proxy_kl_loss's rows kernel for Hopper (sm_90) in Gluon: the loss, the student's lse,
d kl_loss / d q_proxy and the tiles of d kl_loss / d z that kl.py's dk_proxy kernel reads,
as kl.py's rows kernel, with the teacher's products on asynchronous warpgroup MMAs that run
under the exponentials.

A program owns TOKENS tokens of a query block (a block of 16 or 64 tokens takes 1 or 4
programs, neighbours in the launch) and one proxy head, and walks the block's CSR row
(the blocks any of its tokens selected). The teacher needs every query head of the
proxy head's group: the program keeps them in shared memory as CHUNKS tiles [CHUNK_HEADS x
TOKENS, D] of CHUNK_HEADS heads x TOKENS tokens (row = head * TOKENS + token), loaded once
(chunk_heads: 4 heads, or 2 for a group of 4, so that the walk has an even number of
chunks). Keys are the rows of every product, so that a product [64 keys, CHUNK_HEADS x
TOKENS] holds each of a thread's tokens for all the chunk's heads: the sum over heads that
makes the teacher is a thread's own adds.
Three partitions of warps share the program (gl.warp_specialize):

- a producer warp issues TMA loads of the row's K and k_proxy tiles [128, D] into a
  NUM_STAGES-deep shared-memory ring, each slot guarded by a "ready" and an "empty"
  mbarrier;
- two consumer warpgroups, each owning 64 of a block's 128 keys, run per block the
  student's product [64 keys, TOKENS] and the teacher's chunks, issuing chunk c + 1 before
  the exponentials of chunk c.

Per (key, token) a consumer keeps its sums over the walk in registers (the cross term
t (log t - z), the teacher's sum, and without the gradient the student's running max and
sum of exponentials) and reduces them over its keys once at the end; the second consumer
hands its sums to the first through shared memory. With the gradient a first walk over the
student alone finds its lse (the two consumers exchange their halves), and the second
stores (s - t) / N [64 keys, TOKENS] in shared memory, adds its product with the key tile,
transposed, into d q_proxy [D_p, TOKENS] and sends it by a TMA store to the entry's
gradient tile.

Documents, q_blocks (context parallelism), fp32 inputs, query blocks other than 16 or 64,
kv blocks other than 128, D or D_p other than 64 or 128 and groups of query heads other
than 4, 8 or 16 a proxy head take the Triton kernels (supports says which calls these
take).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flash_msa import _env
from flash_msa.ops.gluon.forward import mma_layout, row_layout

TOKENS = 16  # a program's query tokens: the KL layout's query block under granularity "token"
TILE_TOKENS: gl.constexpr = gl.constexpr(TOKENS)  # the same, for the kernels
QUERY_BLOCKS = (TOKENS, 4 * TOKENS)  # the layout's (per token, block-shared): TOKENS a program
HALF_N: gl.constexpr = gl.constexpr(64)  # keys of one consumer warpgroup
KV_BLOCK = 128
HEAD_DIMS = (64, 128)
GROUPS = (4, 8, 16)  # query heads a proxy head: 2 or 4 chunks (the walk takes two a step)
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
NUM_STAGES = 2  # K and k_proxy tiles in flight
CONSUMER_WARPS: gl.constexpr = gl.constexpr(4)  # one warpgroup per consumer
PRODUCER_WARPS: gl.constexpr = gl.constexpr(1)
MAX_REGISTERS = 168  # 64K registers over 384 threads; setmaxnreg splits them as below
CONSUMER_REGISTERS: gl.constexpr = gl.constexpr(240)
PRODUCER_REGISTERS: gl.constexpr = gl.constexpr(24)


def supports(q: torch.Tensor, q_proxy: torch.Tensor, q_block: int, kv_block: int,
             documents: bool, q_blocks: bool) -> bool:  # fmt: skip
    """Whether these kernels take a proxy_kl_loss call: an sm_90 GPU, fp16 / bf16 inputs of
    D and D_p 64 or 128, query blocks of TOKENS or 4 x TOKENS tokens (QUERY_BLOCKS) and kv
    blocks of 128, 4, 8 or 16 query heads a proxy head, no documents and no q_blocks, B * S
    below 2^31 (TMA coordinates)."""
    batch, seq_len, heads_q, head_dim = q.shape
    heads_proxy = q_proxy.shape[2]
    return (
        q.device.type == "cuda" and not _env.interpreting()
        and _env.capability(q.device) == (9, 0) and q.dtype in DTYPES
        and q_proxy.dtype == q.dtype and head_dim in HEAD_DIMS
        and q_proxy.shape[3] in HEAD_DIMS and q_block in QUERY_BLOCKS and kv_block == KV_BLOCK
        and heads_q % heads_proxy == 0 and heads_q // heads_proxy in GROUPS
        and not documents and not q_blocks and batch * seq_len < 2**31
    )  # fmt: skip


def chunk_heads(group: int) -> int:
    """Query heads of one teacher product for `group` query heads a proxy head (one of
    GROUPS): 4, or 2 for a group of 4, so that each entry's walk takes an even number of
    chunks (_teacher_pair takes two a step)."""
    return min(4, group // 2)


def chunk_count(group: int) -> int:
    """Teacher products (chunks of chunk_heads(group) query heads) per kv block and token
    tile: 2 or 4."""
    return group // chunk_heads(group)


@gluon.jit
def _producer(k_desc, kp_desc, k_smem, kp_smem, ready, empty, blocks, key_row, columns,
              GRAD: gl.constexpr):  # fmt: skip
    """The producer warp: with GRAD the row's k_proxy tiles for the first walk, then its K
    and k_proxy tiles for the second. blocks = (col_indices + the row's start, count);
    columns = (K's, k_proxy's) first column in their TMA views."""
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    row_blocks, count = blocks
    k_column, kp_column = columns
    first_walk = 0
    if GRAD:
        first_walk = count
        for position in range(count):
            stage = position % NUM_STAGES
            # A fresh barrier counts as having completed the phase before 0: the first
            # waits pass at once.
            mbarrier.wait(empty.index(stage), ((position // NUM_STAGES) & 1) ^ 1)
            row = key_row + gl.load(row_blocks + position) * KEYS
            mbarrier.expect(ready.index(stage), kp_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kp_desc, [row, kp_column], ready.index(stage),
                                            kp_smem.index(stage))  # fmt: skip
    for entry in range(count):
        position = first_walk + entry
        stage = position % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((position // NUM_STAGES) & 1) ^ 1)
        row = key_row + gl.load(row_blocks + entry) * KEYS
        mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + kp_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, k_column], ready.index(stage),
                                        k_smem.index(stage))  # fmt: skip
        tma.async_copy_global_to_shared(kp_desc, [row, kp_column], ready.index(stage),
                                        kp_smem.index(stage))  # fmt: skip


@gluon.jit
def _entry_words(entry, row_blocks, query_masks, shift, HAS_QUERY_MASKS: gl.constexpr):
    """The kv block of the row's entry `entry` and, with query masks, its word shifted right
    by `shift` (the program's first token in the query block: bit t is then its token t),
    else 0; loaded well before _visible needs them."""
    word = 0
    if HAS_QUERY_MASKS:
        word = gl.load(query_masks + entry) >> shift.to(gl.int64)
    return gl.load(row_blocks + entry), word


@gluon.jit
def _visible(block, word, keys, positions, seq_len, KEYS: gl.constexpr,
             HAS_QUERY_MASKS: gl.constexpr):  # fmt: skip
    """bool [64 keys, TOKENS]: the consumer's keys (offsets `keys` in the block of KEYS) of
    kv block `block` that each token sees: causal, inside the sequence and, with query masks
    (the entry's word), a block the token selected."""
    block_keys = block * KEYS + keys  # [64]
    visible = (gl.expand_dims(block_keys, 1) <= gl.expand_dims(positions, 0)) & gl.expand_dims(
        positions < seq_len, 0
    )
    if HAS_QUERY_MASKS:
        tokens = gl.arange(0, positions.shape[0], layout=positions.type.layout)
        visible &= gl.expand_dims(((word >> tokens.to(gl.int64)) & 1) != 0, 0)
    return visible


@gluon.jit
def _online_lse(running_max, running_sum, logits):
    """Per (key, token) slot, the running max and sum of exp(z - max) after the logits z
    (-inf where not visible)."""
    new_max = gl.maximum(running_max, logits)
    safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * gl.exp(running_max - safe_max) + gl.exp(logits - safe_max)
    return new_max, running_sum


@gluon.jit
def _merge_lse(running_max, running_sum):
    """The slots' (max, sum) merged over their keys: [TOKENS] each."""
    token_max = gl.max(running_max, axis=0)
    safe_max = gl.where(token_max == float("-inf"), 0.0, token_max)
    token_sum = gl.sum(running_sum * gl.exp(running_max - gl.expand_dims(safe_max, 0)), axis=0)
    return token_max, token_sum


@gluon.jit
def _combine_lse(first_max, first_sum, second_max, second_sum):
    """Two halves' (max, sum) as one."""
    token_max = gl.maximum(first_max, second_max)
    safe_max = gl.where(token_max == float("-inf"), 0.0, token_max)
    token_sum = (first_sum * gl.exp(first_max - safe_max)
                 + second_sum * gl.exp(second_max - safe_max))  # fmt: skip
    return token_max, token_sum


@gluon.jit
def _student(kp_keys, qp_smem, acc, is_async: gl.constexpr):
    """The proxy logits [64 keys, TOKENS] (unscaled) of the consumer's keys, into acc's
    registers (its values are not read)."""
    return warpgroup_mma(kp_keys, qp_smem.permute((1, 0)), acc, use_acc=False,
                         is_async=is_async)  # fmt: skip


@gluon.jit
def _issue_chunk(step, first_walk, k_smem, q_smem, ready, acc, HALF: gl.constexpr):
    """The async product S [64 keys, 64] of the walk's step `step`: the consumer's keys of
    entry step // CHUNKS (its K tile in the ring) against the program's query chunk
    step % CHUNKS, into acc's registers (its values are not read); at an entry's first chunk,
    once the entry's slot has landed."""
    NUM_STAGES: gl.constexpr = ready.type.shape[0]
    CHUNKS: gl.constexpr = q_smem.type.shape[0]
    position = first_walk + step // CHUNKS
    stage = position % NUM_STAGES
    if step % CHUNKS == 0:
        mbarrier.wait(ready.index(stage), (position // NUM_STAGES) & 1)
    keys = k_smem.index(stage).slice(HALF * HALF_N, HALF_N)  # [64, D]
    queries = q_smem.index(step % CHUNKS)  # [64, D]
    return warpgroup_mma(keys, queries.permute((1, 0)), acc, use_acc=False, is_async=True)


@gluon.jit
def _chunk_teacher(s, chunk, lse_smem, qk_scale_log2, t_layout: gl.constexpr):
    """fp32 [64 keys, TOKENS]: the sum over the chunk's query heads of their probabilities
    exp2(S scale log2(e) - lse log2(e)) (lse_smem holds lse log2(e) per chunk row), from the
    chunk's product s [64 keys, CHUNK_HEADS x TOKENS]: each thread's own adds."""
    TOKENS: gl.constexpr = t_layout.instr_shape[1]
    CHUNK_HEADS: gl.constexpr = s.type.shape[1] // TOKENS
    lse = lse_smem.index(chunk).load(gl.SliceLayout(0, s.type.layout))  # [CHUNK_HEADS x TOKENS]
    probs = gl.exp2(s * qk_scale_log2 - gl.expand_dims(lse, 0))  # [64 keys, CHUNK_HEADS x TOKENS]
    heads = gl.reshape(probs, [HALF_N, CHUNK_HEADS, TOKENS])
    return gl.convert_layout(gl.sum(heads, axis=1), t_layout)


@gluon.jit
def _start_walk(first_walk, k_smem, q_smem, ready, t_layout: gl.constexpr, HALF: gl.constexpr):
    """_teacher_pair's products before a walk's first pair: step 0's S issued, the other
    tiles zeros (the student's logits and the teacher [64 keys, TOKENS] in t_layout)."""
    TOKENS: gl.constexpr = t_layout.instr_shape[1]
    CHUNK_ROWS: gl.constexpr = q_smem.type.shape[1]  # CHUNK_HEADS x TOKENS
    s_layout: gl.constexpr = mma_layout(CHUNK_ROWS, k_smem.dtype)  # [64 keys, CHUNK_ROWS]
    spare = gl.zeros([HALF_N, CHUNK_ROWS], gl.float32, s_layout)
    even = _issue_chunk(0, first_walk, k_smem, q_smem, ready, spare, HALF)
    zeros = gl.zeros([HALF_N, TOKENS], gl.float32, t_layout)
    return even, spare, zeros, zeros


@gluon.jit
def _teacher_pair(pair, steps, first_walk, tiles, products, qk_scale_log2, HALF: gl.constexpr):
    """Steps pair and pair + 1 of a walk of `steps` (a step per (entry, chunk); CHUNKS even,
    so both are of one entry): chunk pair's S (issued the step before) waited for, pair + 1's
    issued and the student's product [64 keys, TOKENS] issued beside it, pair's
    exponentials, pair + 1's waited for, pair + 2's issued, pair + 1's exponentials. Where
    the walk has no step pair + 2, the step steps - 2 runs again, unread (its tiles stay in
    the ring: the producer loads no more). tiles = (k_smem, q_smem, ready, kp_keys, qp: the
    program's q_proxy rows, lse_smem); products = (even, odd, logits, teacher). Returns the
    products, teacher summed over both chunks' heads."""
    k_smem, q_smem, ready, kp_keys, qp, lse_smem = tiles
    even, odd, logits, teacher = products
    CHUNKS: gl.constexpr = lse_smem.type.shape[0]
    t_layout: gl.constexpr = teacher.type.layout
    done = warpgroup_mma_wait(0, deps=(even,))
    odd = _issue_chunk(pair + 1, first_walk, k_smem, q_smem, ready, odd, HALF)
    # The student's product, read at the entry's last chunk (with 4 chunks also issued at
    # the second, unread: an async product cannot be issued conditionally).
    logits = _student(kp_keys, qp, logits, True)
    chunk = pair % CHUNKS
    teacher += _chunk_teacher(done, chunk, lse_smem, qk_scale_log2, t_layout)
    odd, logits = warpgroup_mma_wait(0, deps=(odd, logits))
    even = _issue_chunk(gl.minimum(pair + 2, steps - 2), first_walk, k_smem, q_smem, ready,
                        done, HALF)  # fmt: skip
    teacher += _chunk_teacher(odd, chunk + 1, lse_smem, qk_scale_log2, t_layout)
    return even, odd, logits, teacher


@gluon.jit
def _add_gradient(logits, teacher, student_lse, coefficient, kp_keys, grad_mine, grad_q,
                  grad_desc, tile_row, tile_column):  # fmt: skip
    """grad_q [D_p, TOKENS] (transposed) plus k_proxy^T (s - t) coefficient over the entry's
    keys: (s - t) coefficient [64 keys, TOKENS] goes through shared memory (grad_mine) as the
    product's B operand, and from there by a TMA store to (tile_row, tile_column) of
    grad_desc (the dk_proxy kernel's tiles). student_lse is +inf where a token sees no key:
    its student is 0."""
    student = gl.exp(logits - gl.expand_dims(student_lse, 0))  # 0 where not visible
    tma.store_wait(0)  # the entry before's tile has left grad_mine
    gl.thread_barrier()
    grad_mine.store(((student - teacher) * coefficient).to(grad_mine.dtype))
    fence_async_shared()
    gl.thread_barrier()
    grad_q = warpgroup_mma(kp_keys.permute((1, 0)), grad_mine, grad_q, is_async=True)
    tma.async_copy_shared_to_global(grad_desc, [tile_row, tile_column], grad_mine)
    return warpgroup_mma_wait(0, deps=(grad_q,))


@gluon.jit
def _add_sums(sums, logits, teacher, GRAD: gl.constexpr):
    """The per-slot sums after an entry's logits z and teacher t [64 keys, TOKENS]: the cross
    term t (log t - z), the teacher's sum and, without GRAD, the student's running max and
    sum of exponentials."""
    cross, teacher_sum, running_max, running_sum = sums
    used = teacher != 0  # visible and not underflowed (or NaN, kept): elsewhere 0
    log_ratio = gl.log(gl.where(used, teacher, 1.0)) - gl.where(used, logits, 0.0)
    cross += gl.where(used, teacher * log_ratio, 0.0)
    teacher_sum += teacher
    if not GRAD:
        running_max, running_sum = _online_lse(running_max, running_sum, logits)
    return cross, teacher_sum, running_max, running_sum


@gluon.jit
def _consumer(shared, row_values, outputs, scales, HALF: gl.constexpr, GRAD: gl.constexpr,
              HAS_QUERY_MASKS: gl.constexpr):  # fmt: skip
    """One warpgroup's 64 keys of every block of the row: the walk(s), then (the first
    consumer) the program's outputs. shared: the kernel's shared-memory tiles and barriers;
    row_values = (row_blocks, query_masks, count, first token, seq_len, grad_desc: the
    gradient tiles' TMA view [tiles x 128 keys, query block], its row of the row's first
    entry's tile, the program's first column there: its first token in the query block);
    outputs = (lse_proxy, kl_rows: the row's [TOKENS] of [B, H_p, S], grad_q_proxy:
    its first token's row, its token stride); scales = (proxy_scale, qk_scale_log2, 1 / group,
    grad_scale)."""
    (q_smem, qp_smem, lse_smem, k_smem, kp_smem, ready, empty, grad_smem, grad_partial, exchange,
     exchanged, partial_smem, partial_ready) = shared  # fmt: skip
    row_blocks, query_masks, count, first, seq_len, grad_desc, tile_first, tile_column = (
        row_values
    )
    proxy_scale, qk_scale_log2, inverse_group, grad_scale = scales
    dtype: gl.constexpr = q_smem.dtype
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    KEYS: gl.constexpr = k_smem.type.shape[1]  # a block's
    TOKENS: gl.constexpr = qp_smem.type.shape[0]
    PROXY_DIM: gl.constexpr = qp_smem.type.shape[1]
    t_layout: gl.constexpr = mma_layout(TOKENS, dtype)  # [64 keys, TOKENS]
    token_layout: gl.constexpr = gl.SliceLayout(0, t_layout)
    keys = HALF * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, t_layout))  # [64]
    positions = first + gl.arange(0, TOKENS, layout=token_layout)  # [TOKENS]
    running_max = gl.full([HALF_N, TOKENS], float("-inf"), gl.float32, t_layout)
    running_sum = gl.zeros([HALF_N, TOKENS], gl.float32, t_layout)
    first_walk = 0
    if GRAD:  # the student's lse first: the gradient needs it in the walk below
        first_walk = count
        for entry in range(count):
            stage = entry % NUM_STAGES
            mbarrier.wait(ready.index(stage), (entry // NUM_STAGES) & 1)
            kp_keys = kp_smem.index(stage).slice(HALF * HALF_N, HALF_N)  # [64, D_p]
            block, word = _entry_words(entry, row_blocks, query_masks, tile_column,
                                       HAS_QUERY_MASKS)  # fmt: skip
            logits = _student(kp_keys, qp_smem, gl.zeros_like(running_sum), False)
            mbarrier.arrive(empty.index(stage))
            visible = _visible(block, word, keys, positions, seq_len, KEYS, HAS_QUERY_MASKS)
            logits = gl.where(visible, logits * proxy_scale, float("-inf"))
            running_max, running_sum = _online_lse(running_max, running_sum, logits)
        token_max, token_sum = _merge_lse(running_max, running_sum)
        exchange.index(2 * HALF).store(token_max)
        exchange.index(2 * HALF + 1).store(token_sum)
        mbarrier.arrive(exchanged.index(HALF))
        mbarrier.wait(exchanged.index(1 - HALF), 0)
        first_max = exchange.index(0).load(token_layout)
        first_sum = exchange.index(1).load(token_layout)
        second_max = exchange.index(2).load(token_layout)
        second_sum = exchange.index(3).load(token_layout)
        token_max, token_sum = _combine_lse(first_max, first_sum, second_max, second_sum)
        seen = token_sum != 0  # != : a NaN input stays NaN
        # +inf where a token sees no key: its student is 0
        student_lse = gl.where(seen, token_max + gl.log(gl.where(seen, token_sum, 1.0)),
                               float("inf"))  # fmt: skip
        coefficient = gl.load(grad_scale)
    grad_t_layout: gl.constexpr = mma_layout(TOKENS, dtype)  # [D_p, TOKENS] over 4 warps
    grad_q = gl.zeros([PROXY_DIM, TOKENS], gl.float32, grad_t_layout)  # transposed
    grad_mine = grad_smem.index(HALF)  # [64 keys, TOKENS]
    # The second walk, a step per (entry, chunk), two steps a loop (_teacher_pair); an
    # entry's last step ends the entry. Where the walk has no next step, the last even one
    # runs again, unread (its tiles stay in the ring: the producer loads no more).
    CHUNKS: gl.constexpr = q_smem.type.shape[0]
    cross = gl.zeros([HALF_N, TOKENS], gl.float32, t_layout)  # t (log t - z) per slot
    teacher_sum = gl.zeros([HALF_N, TOKENS], gl.float32, t_layout)
    sums = (cross, teacher_sum, running_max, running_sum)
    steps = count * CHUNKS  # even: CHUNKS is
    if steps > 0:
        products = _start_walk(first_walk, k_smem, q_smem, ready, t_layout, HALF)
        for pair in range(0, steps, 2):
            entry = pair // CHUNKS
            stage = (first_walk + entry) % NUM_STAGES
            block, word = _entry_words(entry, row_blocks, query_masks, tile_column,
                                       HAS_QUERY_MASKS)  # fmt: skip
            kp_keys = kp_smem.index(stage).slice(HALF * HALF_N, HALF_N)  # [64, D_p]
            tiles = (k_smem, q_smem, ready, kp_keys, qp_smem, lse_smem)
            products = _teacher_pair(pair, steps, first_walk, tiles, products, qk_scale_log2,
                                     HALF)  # fmt: skip
            even, odd, logits, teacher = products
            if (pair + 1) % CHUNKS == CHUNKS - 1:
                visible = _visible(block, word, keys, positions, seq_len, KEYS, HAS_QUERY_MASKS)
                logits = gl.where(visible, logits * proxy_scale, float("-inf"))
                teacher = gl.where(visible, teacher * inverse_group, 0.0)
                if GRAD:
                    grad_q = _add_gradient(
                        logits, teacher, student_lse, coefficient, kp_keys, grad_mine, grad_q,
                        grad_desc, tile_first + entry * KEYS + HALF * HALF_N, tile_column,
                    )  # fmt: skip
                sums = _add_sums(sums, logits, teacher, GRAD)
                mbarrier.arrive(empty.index(stage))
                teacher = gl.zeros([HALF_N, TOKENS], gl.float32, t_layout)
            products = (even, odd, logits, teacher)
        warpgroup_mma_wait(0, deps=(products[0],))
    if GRAD:
        tma.store_wait(0)  # grad_mine is read until the last tile's store completes
    cross, teacher_sum, running_max, running_sum = sums
    token_cross = gl.sum(cross, axis=0)  # [TOKENS]
    token_teacher = gl.sum(teacher_sum, axis=0)
    if not GRAD:
        token_max, token_sum = _merge_lse(running_max, running_sum)
    if HALF == 1:  # hand the sums to the first consumer
        partial_smem.index(0).store(token_cross)
        partial_smem.index(1).store(token_teacher)
        if GRAD:
            grad_partial.store(grad_q)
        else:
            partial_smem.index(2).store(token_max)
            partial_smem.index(3).store(token_sum)
        mbarrier.arrive(partial_ready)
    else:
        lse_proxy, kl_rows, grad_row, stride_qp_s = outputs
        mbarrier.wait(partial_ready, 0)
        token_cross += partial_smem.index(0).load(token_layout)
        token_teacher += partial_smem.index(1).load(token_layout)
        if not GRAD:
            token_max, token_sum = _combine_lse(
                token_max, token_sum, partial_smem.index(2).load(token_layout),
                partial_smem.index(3).load(token_layout),
            )  # fmt: skip
        seen = token_sum != 0
        lse_p = gl.where(seen, token_max + gl.log(gl.where(seen, token_sum, 1.0)),
                         float("-inf"))  # fmt: skip
        kl = gl.where(token_teacher != 0, token_cross + lse_p * token_teacher, 0.0)
        tokens = gl.arange(0, TOKENS, layout=token_layout)
        valid = positions < seq_len
        gl.store(lse_proxy + tokens, lse_p, mask=valid)
        gl.store(kl_rows + tokens, kl, mask=valid)
        if GRAD:
            grad_q += grad_partial.load(grad_t_layout)
            dims = gl.arange(0, PROXY_DIM, layout=gl.SliceLayout(1, grad_t_layout))
            grad_tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, grad_t_layout))
            pointers = (grad_row + gl.expand_dims(grad_tokens.to(gl.int64) * stride_qp_s, 0)
                        + gl.expand_dims(dims, 1))  # fmt: skip  # [D_p, TOKENS]
            gl.store(pointers, (grad_q * proxy_scale).to(dtype),
                     mask=gl.expand_dims(first + grad_tokens < seq_len, 0))  # fmt: skip


@gluon.jit
def _kl_rows_kernel(
    q_proxy, q, lse, k_desc, kp_desc, row_offsets, col_indices, query_masks, grad_scale,
    lse_proxy, kl_rows, grad_q_proxy, grad_desc,
    stride_qp_b, stride_qp_s, stride_qp_h, stride_q_b, stride_q_s, stride_q_h, stride_lse_b,
    stride_lse_h, seq_len, heads_proxy, proxy_group, kv_group, group, heads_per_layout,
    num_q_blocks, proxy_scale, qk_scale_log2, layout_row, block_start, entry_start,
    chunk_entries, batch_base, head_base,
    HEAD_DIM: gl.constexpr, PROXY_DIM: gl.constexpr, CHUNKS: gl.constexpr,
    CHUNK_HEADS: gl.constexpr, HAS_QUERY_MASKS: gl.constexpr, GRAD: gl.constexpr,
    NUM_STAGES: gl.constexpr, SUBTILES: gl.constexpr,
):  # fmt: skip
    """One program per (TOKENS tokens of a query block, copy) of a chunk: kl._kl_rows_kernel's
    grid and chunk arguments with SUBTILES programs a query block (of SUBTILES x TOKENS
    tokens), each walking the block's row for its tokens; writing the same lse_proxy and
    kl_rows [B, H_p, S] and, with GRAD, grad_q_proxy (times grad_scale, d kl_loss / d
    kl(i, p)) and the entries' tiles of d kl_loss / d z through grad_desc (a TMA view
    [tiles x 128 keys, SUBTILES x TOKENS] in boxes of [64, TOKENS]). k_desc, kp_desc: TMA
    views [B * S, H_kv * D] and [B * S, H_pk * D_p] in blocks of [128, D] and [128, D_p];
    query_masks: int64 [nnz] aligned with col_indices with HAS_QUERY_MASKS."""
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = k_desc.dtype
    TOKENS: gl.constexpr = TILE_TOKENS
    CHUNK_ROWS: gl.constexpr = CHUNK_HEADS * TOKENS
    block = block_start + gl.program_id(0) // SUBTILES
    tile_column = (gl.program_id(0) % SUBTILES) * TOKENS  # its first token's, in the block
    batch = batch_base + gl.program_id(1) // heads_per_layout
    head = head_base + gl.program_id(1) % heads_per_layout
    first = block * (SUBTILES * TOKENS) + tile_column
    row = row_offsets + layout_row * (num_q_blocks + 1) + block
    start = gl.load(row)
    count = gl.load(row + 1) - start

    # The group's query rows and their lse (times log2 e), once, into shared memory.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK_ROWS, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CHUNKS, CHUNK_ROWS, HEAD_DIM], q_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [CHUNKS, CHUNK_ROWS], flat)
    load_layout: gl.constexpr = row_layout(HEAD_DIM)  # [64, D] over 4 warps
    rows = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(1, load_layout))  # [CHUNK_ROWS]
    tokens = first + rows % TOKENS
    in_sequence = tokens < seq_len
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    q_base = q + batch.to(gl.int64) * stride_q_b + tokens.to(gl.int64) * stride_q_s
    lse_base = lse + batch.to(gl.int64) * stride_lse_b + tokens
    for chunk in gl.static_range(CHUNKS):
        heads_q = head * group + chunk * CHUNK_HEADS + rows // TOKENS  # [CHUNK_ROWS]
        q_rows = q_base + heads_q.to(gl.int64) * stride_q_h
        q_smem.index(chunk).store(gl.load(gl.expand_dims(q_rows, 1) + gl.expand_dims(dims, 0),
                                          mask=gl.expand_dims(in_sequence, 1), other=0.0))
        lse_rows = gl.load(lse_base + heads_q.to(gl.int64) * stride_lse_h, mask=in_sequence,
                           other=0.0)  # fmt: skip
        lse_smem.index(chunk).store(lse_rows * 1.4426950408889634)
    qp_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TOKENS, PROXY_DIM], dtype)
    qp_smem = gl.allocate_shared_memory(dtype, [TOKENS, PROXY_DIM], qp_layout)
    qp_load: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[32 // (PROXY_DIM // 8), PROXY_DIM // 8],
        warps_per_cta=[4, 1], order=[1, 0],
    )  # fmt: skip
    qp_tokens = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, qp_load))
    qp_dims = gl.arange(0, PROXY_DIM, layout=gl.SliceLayout(0, qp_load))
    qp_row = q_proxy + batch.to(gl.int64) * stride_qp_b + head * stride_qp_h
    qp_offsets = (gl.expand_dims((first + qp_tokens).to(gl.int64) * stride_qp_s, 1)
                  + gl.expand_dims(qp_dims, 0))  # fmt: skip
    qp_smem.store(gl.load(qp_row + qp_offsets,
                          mask=gl.expand_dims(first + qp_tokens < seq_len, 1), other=0.0))

    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, KEYS, HEAD_DIM], k_desc.layout)
    kp_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, KEYS, PROXY_DIM], kp_desc.layout)
    grad_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, TOKENS], dtype)
    grad_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, TOKENS], grad_layout)
    partial_smem = gl.allocate_shared_memory(gl.float32, [4, TOKENS], flat)
    exchange = gl.allocate_shared_memory(gl.float32, [4, TOKENS], flat)
    grad_partial = gl.allocate_shared_memory(gl.float32, [PROXY_DIM, TOKENS],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    exchanged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    partial_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(exchanged.index(i), count=1)
    mbarrier.init(partial_ready, count=1)
    fence_async_shared()

    row_blocks = col_indices + start
    tile_first = (gl.program_id(1) * chunk_entries + start - entry_start) * KEYS
    row_values = (row_blocks, query_masks + start, count, first, seq_len, grad_desc, tile_first,
                  tile_column)  # fmt: skip
    stats = batch * heads_proxy * seq_len + head * seq_len + first  # into [B, H_p, S]
    grad_row = (grad_q_proxy + batch.to(gl.int64) * stride_qp_b + head * stride_qp_h
                + first.to(gl.int64) * stride_qp_s)  # fmt: skip
    outputs = (lse_proxy + stats, kl_rows + stats, grad_row, stride_qp_s)
    scales = (proxy_scale, qk_scale_log2, 1.0 / group, grad_scale)
    shared = (q_smem, qp_smem, lse_smem, k_smem, kp_smem, ready, empty, grad_smem, grad_partial,
              exchange, exchanged, partial_smem, partial_ready)  # fmt: skip
    key_row = batch * seq_len
    columns = ((head // kv_group) * HEAD_DIM, (head // proxy_group) * PROXY_DIM)
    # The default partition (this kernel's 4 warps) is the first consumer.
    gl.warp_specialize(
        [(_consumer, (shared, row_values, outputs, scales, 0, GRAD, HAS_QUERY_MASKS)),
         (_consumer, (shared, row_values, outputs, scales, 1, GRAD, HAS_QUERY_MASKS)),
         (_producer, (k_desc, kp_desc, k_smem, kp_smem, ready, empty, (row_blocks, count),
                      key_row, columns, GRAD))],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor whose base TMA can address (16-byte aligned): itself, or a copy."""
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def _key_descriptor(tensor: torch.Tensor) -> TensorDescriptor:
    """The TMA view [B * S, H * D] of contiguous keys [B, S, H, D] in blocks [KV_BLOCK, D]."""
    batch, seq_len, heads, dim = tensor.shape
    flat = _aligned(tensor).view(batch * seq_len, heads * dim)
    layout = gl.NVMMASharedLayout.get_default_for([KV_BLOCK, dim], DTYPES[tensor.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [KV_BLOCK, dim], layout)


def _tile_descriptor(grad_tiles: torch.Tensor, q_block: int) -> TensorDescriptor:
    """The TMA view [tiles x 128 keys, q_block] of the gradient tiles (flat, contiguous) in
    boxes of one consumer's [64 keys, TOKENS]."""
    flat, block = grad_tiles.view(-1, q_block), [HALF_N.value, TOKENS]
    layout = gl.NVMMASharedLayout.get_default_for(block, DTYPES[grad_tiles.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def kl_rows(q_proxy, k_proxy, q, k, lse, row_offsets, col_indices, query_masks, layout,
            grad_scale, outputs, proxy_scale: float, softmax_scale: float, grid: tuple,
            chunk: dict) -> None:  # fmt: skip
    """Fill outputs = (lse_proxy, kl_rows, grad_q_proxy or None, grad_tiles) for one chunk of
    kl's rows kernel (its grid and chunk arguments), as that kernel does, over `layout` (a
    BlockLayout of q_block x 128 blocks, q_block one of QUERY_BLOCKS, whose row_offsets /
    col_indices these are, a program for each TOKENS tokens of a query block; query_masks
    its int64 words or None); grad_tiles (flat, 16-byte aligned) is read with
    grad_q_proxy only. Contiguous inputs; the caller checked the call (supports)."""
    lse_proxy, kl_rows_out, grad_q_proxy, grad_tiles = outputs
    batch, seq_len, heads_proxy, proxy_dim = q_proxy.shape
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    with_grad = grad_q_proxy is not None
    has_masks = query_masks is not None
    group = heads_q // heads_proxy
    subtiles = layout.q_block // TOKENS
    _kl_rows_kernel[(grid[0] * subtiles, *grid[1:])](
        q_proxy=q_proxy, q=q, lse=lse, k_desc=_key_descriptor(k),
        kp_desc=_key_descriptor(k_proxy), row_offsets=row_offsets,
        col_indices=col_indices, query_masks=query_masks if has_masks else col_indices,
        grad_scale=grad_scale, lse_proxy=lse_proxy, kl_rows=kl_rows_out,
        grad_q_proxy=grad_q_proxy if with_grad else q_proxy,
        grad_desc=_tile_descriptor(grad_tiles, layout.q_block),
        stride_qp_b=q_proxy.stride(0), stride_qp_s=q_proxy.stride(1),
        stride_qp_h=q_proxy.stride(2), stride_q_b=q.stride(0), stride_q_s=q.stride(1),
        stride_q_h=q.stride(2), stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1),
        seq_len=seq_len, heads_proxy=heads_proxy, proxy_group=heads_proxy // k_proxy.shape[2],
        kv_group=heads_proxy // heads_kv, group=group,
        heads_per_layout=heads_proxy // layout.layout_heads, num_q_blocks=layout.num_q_blocks,
        proxy_scale=proxy_scale, qk_scale_log2=softmax_scale * _env.LOG2_E, **chunk,
        HEAD_DIM=head_dim, PROXY_DIM=proxy_dim, CHUNKS=chunk_count(group),
        CHUNK_HEADS=chunk_heads(group), HAS_QUERY_MASKS=has_masks, GRAD=with_grad,
        NUM_STAGES=NUM_STAGES, SUBTILES=subtiles, num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip


def _compile(kernel, types: dict, constexprs: dict, workdir: str, name: str) -> dict:
    """ops.gluon.codegen.compile_kernel's report of `kernel` for sm_90a, plus
    "exponentials_under_products": the most MUFU.EX2 between a product's issue and the next
    MMA wait (0 if they do not overlap)."""
    from flash_msa.ops.gluon import codegen

    report = codegen.compile_kernel(kernel, types, constexprs, workdir, name)
    with open(report["sass"]) as handle:
        report["exponentials_under_products"] = codegen.instructions_under_mma(
            handle.read(), "MUFU.EX2"
        )
    return report


def compile_for_sm90(workdir: str, dtype: str = "bf16", head_dim: int = 128,
                     proxy_dim: int = 128, grad: bool = True, group: int = 16,
                     q_block: int = TOKENS) -> dict:  # fmt: skip
    """Compile the kernel for sm_90a without a GPU (with query masks; `group` query heads a
    proxy head; query blocks of q_block) and report as _compile does."""
    from flash_msa.ops.gluon import codegen

    pointer = f"*{dtype}"
    types = dict(
        q_proxy=pointer, q=pointer, lse="*fp32",
        k_desc=codegen.descriptor_type(dtype, KV_BLOCK, head_dim),
        kp_desc=codegen.descriptor_type(dtype, KV_BLOCK, proxy_dim),
        row_offsets="*i32", col_indices="*i32", query_masks="*i64", grad_scale="*fp32",
        lse_proxy="*fp32", kl_rows="*fp32", grad_q_proxy=pointer,
        grad_desc=codegen.descriptor_type(dtype, HALF_N.value, TOKENS), proxy_scale="fp32",
        qk_scale_log2="fp32",
    )  # fmt: skip
    constexprs = dict(HEAD_DIM=head_dim, PROXY_DIM=proxy_dim, CHUNKS=chunk_count(group),
                      CHUNK_HEADS=chunk_heads(group), HAS_QUERY_MASKS=True, GRAD=grad,
                      NUM_STAGES=NUM_STAGES, SUBTILES=q_block // TOKENS)  # fmt: skip
    name = (f"kl_rows_{dtype}_d{head_dim}_dp{proxy_dim}_g{group}_q{q_block}"
            f"{'_grad' if grad else ''}")  # fmt: skip
    return _compile(_kl_rows_kernel, types, constexprs, workdir, name)
