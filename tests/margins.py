"""Argmax comparisons between two computations of different precision (an fp16 bundle against transformers' fp32,
4-bit weights against their float selves, the MIL executor against torch, a verify call against decode steps):
equal where the reference's choice is clear, and where it is a near-tie, only as close as the precision allows.

Why 2 x err: when every logit of ours is within `err` of the reference's, ours can rank token j above the
reference's argmax i only if ref[i] - err <= ref[j] + err, that is, if the reference's top two are within 2 x err.
So an argmax is asserted equal where the reference's top-1/top-2 margin exceeds 2 x err; below that either token
is a right answer, and ours must still be one of the near-tied tokens (its reference logit within 2 x err of the
top): a wrong logit row fails either way, a tie never does. A greedy sequence is compared up to the first step
whose reference margin is a near-tie (after it, the two runs continue from different, equally valid tokens), and
the caller states how many steps must have been compared for the test to mean something."""

from contextlib import contextmanager

import numpy as np


def _row(logits):
    """A reference row as {token: logit}: a full logit vector, or a dict of the top few (logprobs differ from
    logits by one constant a row, so their margins are the same)."""
    if isinstance(logits, dict):
        return {int(k): float(v) for k, v in logits.items()}
    row = np.asarray(logits, np.float64).ravel()
    top = np.argpartition(row, -2)[-2:]
    return {int(t): float(row[t]) for t in top} | {"row": row}


def margin(logits) -> float:
    """The reference's top-1 minus top-2 logit."""
    values = sorted((v for k, v in _row(logits).items() if k != "row"), reverse=True)
    return values[0] - values[1]


def assert_argmax(ours: int, ref_logits, err: float, where="") -> bool:
    """`ours` (a token id) is the argmax of `ref_logits` when the reference's margin exceeds 2 x err, else one of
    its near-tied tokens. Returns whether the comparison was an exact one (the margin was clear)."""
    row = _row(ref_logits)
    full = row.pop("row", None)
    top = max(row, key=row.get)
    m = margin(row)
    if m > 2 * err:
        assert ours == top, f"{where}: argmax {ours}, the reference's {top} (its margin {m:.4g} > 2 x {err})"
        return True
    # outside a dict's top few, ours is at most the last of them: tied only if even that one is in the window
    mine = full[ours] if full is not None else row.get(ours, min(row.values()))
    assert mine >= row[top] - 2 * err, f"{where}: {ours} is {row[top] - mine:.4g} below the reference's top ({top})"
    return False


def assert_greedy_prefix(ours, ref, ref_rows, err: float, min_steps: int, where="") -> int:
    """Greedy sequences `ours` and `ref` equal up to the first step whose reference row (`ref_rows[i]`, the logits
    the reference chose ref[i] from) is a near-tie, ours' token there one of the tied ones, and at least min_steps
    steps compared. Returns the number compared."""
    ours, ref = list(ours), list(ref)
    n = min(len(ref), len(ref_rows))
    # strictly below: with err 0 (rows equal to the bit) even an exact tie is broken alike by both argmaxes
    tie = next((i for i in range(n) if margin(ref_rows[i]) < 2 * err), n)
    assert tie >= min_steps, f"{where}: a near-tie at step {tie}; the test needs {min_steps} clear steps"
    assert ours[:tie] == ref[:tie], f"{where}: {ours[:tie]} != {ref[:tie]} (no near-tie before step {tie})"
    if tie < min(len(ours), n):
        assert_argmax(ours[tie], ref_rows[tie], err, f"{where} step {tie}")
    return tie


def assert_top1(report: dict, err: float, where="") -> int:
    """A verify report's (`oracle.verify.compare`) top-1 agreement, margin-aware: at every position where ours'
    argmax is not the reference's, the reference's top logit is at most 2 x err above its logit for our token.
    `err` is a stated bound on the |logit error| of the two computations, not the run's own max |logit diff|
    (against which every miss is a near-tie by construction). Returns the number of (tied) misses."""
    wide = [m for m in report["top1_misses"] if m["ref_gap"] > 2 * err]
    assert not wide, f"{where}: top-1 misses that are no near-tie (reference gap > 2 x {err}): {wide}"
    return len(report["top1_misses"])


def repetition_penalised(rows, history, generated, penalty: float) -> np.ndarray:
    """transformers' RepetitionPenaltyLogitsProcessor on rows[i], the logits that chose generated[i]: each token of
    history + generated[:i] divided by `penalty` where positive, multiplied where negative (the runtime's rule too).
    For measuring our rows' error against the scores transformers' greedy `generate` chose from."""
    out = np.array(rows, np.float64)
    for i, row in enumerate(out):
        seen = np.unique(np.asarray(list(history) + list(generated[:i]), np.int64))
        row[seen] = np.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
    return out


@contextmanager
def recorded_rows(engine):
    """Yields a list that fills with the logit rows generation on `engine` chooses its tokens from: the prompt's
    last row (engine.prompt) and the row of each token fed after it, as float64 (the published head has none)."""
    rows, prompt, feed, inside = [], engine.prompt, engine.feed, []

    def recording_prompt(*args, **kw):
        inside.append(1)
        try:
            reused, logits = prompt(*args, **kw)
        finally:
            inside.pop()
        rows.append(np.asarray(logits, np.float64).ravel())
        return reused, logits

    def recording_feed(ids, **kw):
        out = feed(ids, **kw)
        if not inside and kw.get("logits", "last") == "last":  # the prompt's own feeds are recorded as its row
            rows.append(np.asarray(out[-1], np.float64).ravel())
        return out

    engine.prompt, engine.feed = recording_prompt, recording_feed
    try:
        yield rows
    finally:
        del engine.prompt, engine.feed  # the instance attributes go; the class's methods show through again


def assert_same_greedy(ours, ours_rows, ref, ref_rows, bound: float, min_steps: int, history=(), penalty=1.0, where=""):
    """Two greedy runs of one model whose arithmetic differs (a reused prefix against a fresh prefill: other batch
    shapes, so other fp16 roundings): their logit rows, penalised as the sampler penalised them (`history`: the
    prompt ids, `penalty`: repetition_penalty), differ by at most the measured err <= `bound` up to the first token
    where they part (that row included: both runs chose from the same history there), and the tokens agree as
    assert_greedy_prefix says with that err. A prefix reused from the wrong place moves the rows far beyond
    `bound`. Returns (steps compared, err)."""
    ours, ref = list(ours), list(ref)
    n = min(len(ours), len(ref), len(ours_rows), len(ref_rows))
    part = next((i for i in range(n) if ours[i] != ref[i]), n - 1)
    a = repetition_penalised(ours_rows[: part + 1], history, ours, penalty)
    b = repetition_penalised(ref_rows[:n], history, ref, penalty)
    err = float(np.abs(a - b[: part + 1]).max())
    assert err <= bound, f"{where}: the two runs' logit rows differ by {err:.4g} (> {bound}) within step {part}"
    return assert_greedy_prefix(ours[:n], ref[:n], b, err, min_steps, where), err
