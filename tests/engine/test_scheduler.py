"""The scheduler on plain data, without a model or a device: the step's token budget, chunked prefill,
which request is preempted and where it goes, prefix-cache hits, and aborts."""

from __future__ import annotations

from fp8route.engine.config import EngineConfig
from fp8route.engine.request import Request, RequestMetrics, Status
from fp8route.engine.sampling import SamplingParams
from fp8route.engine.scheduler import Scheduler
from fp8route.engine.scheduler_output import NewRequest, SchedulerOutput

BLOCK = 4


def scheduler(
    blocks: int = 64,
    max_num_seqs: int = 8,
    budget: int = 32,
    max_model_len: int = 256,
    caching: bool = True,
    admission: str = "on_demand",
) -> Scheduler:
    """blocks: the pool's, the scratch block among them."""
    config = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, block_size=BLOCK,
        enable_prefix_caching=caching, admission=admission,
    )  # fmt: skip
    return Scheduler(config, blocks)


def request(name: str, prompt: list[int], max_tokens: int = 8, **params: object) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(name, prompt, sampling, 0, RequestMetrics(0.0), max_tokens=max_tokens)


def read_back(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does once a step's tokens are on the host: every piece's full blocks into the
    prefix cache, and each sampling piece's token appended to its request."""
    known = {r.request_id: r for r in [*s.running, *s.waiting]}
    for piece in out.seqs:
        request = known[piece.request_id]
        s.computed(request, piece)
        if piece.samples:
            request.num_pending -= 1
            request.token_ids.append(token)


def pieces(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(p.request_id, p.start, p.num_tokens, p.samples) for p in out.seqs]


def test_a_step_takes_at_most_the_token_budget_and_the_rest_of_a_prompt_waits_its_turn():
    s = scheduler(budget=10)
    a, b, c = request("a", [1] * 6), request("b", [2] * 6), request("c", [3] * 6)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    # a whole, then b's first 4 tokens: a chunk that does not sample; c is not admitted (no budget left).
    assert pieces(out) == [("a", 0, 6, True), ("b", 0, 4, False)] and out.num_tokens == 10
    assert list(s.waiting) == [c] and c.status is Status.WAITING
    read_back(s, out)
    out = s.schedule()
    # Running requests first, oldest first: a's decode (one token), b's last 2, then c's 6 of the 7 left.
    assert pieces(out) == [("a", 6, 1, True), ("b", 4, 2, True), ("c", 0, 6, True)] and out.num_tokens == 9


def test_a_long_prompt_runs_in_chunks_of_the_budget_beside_a_decode_that_moves_every_step():
    s = scheduler(budget=8)
    stream = request("stream", [5, 6, 7], max_tokens=20)
    s.add(stream)
    read_back(s, s.schedule())
    long = request("long", list(range(20)))
    s.add(long)
    seen = []
    while long.num_computed < 20:
        out = s.schedule()
        assert out.seqs[0].request_id == "stream" and out.seqs[0].num_tokens == 1  # the decode leads, every step
        seen.append(pieces(out)[1])
        read_back(s, out)
    # The chunk takes what the decode leaves; only the last samples.
    assert seen == [("long", 0, 7, False), ("long", 7, 7, False), ("long", 14, 6, True)]
    assert s.schedule().singles == 2  # both decode now, one token each


def test_decodes_lead_a_step_and_chunks_follow_them():
    s = scheduler(budget=64)
    first = request("first", [1] * 3)
    s.add(first)
    read_back(s, s.schedule())
    s.add(request("second", [2] * 9))
    out = s.schedule()
    assert pieces(out) == [("first", 3, 1, True), ("second", 0, 9, True)] and out.singles == 1


def test_the_newest_running_request_is_preempted_first_and_goes_back_to_the_front_of_the_queue():
    s = scheduler(blocks=20, budget=64)
    a, b, c = request("a", [1] * 4), request("b", [2] * 4), request("c", [3] * 4)
    for r in (a, b, c):
        s.add(r)
    read_back(s, s.schedule())  # each prompt fills its one block; each decode now needs a second
    assert [r.row for r in (a, b, c)] == [0, 1, 2]
    held = s.blocks.allocate(s.blocks.free_blocks)  # something else holds every free block
    assert held is not None
    c_block = c.blocks[0]
    out = s.schedule()
    # a needs a block: c, the newest, gives its one up; then b needs one and is itself the newest.
    assert out.preempted_ids == ["c", "b"] and pieces(out) == [("a", 4, 1, True)]
    assert a.blocks == [a.blocks[0], c_block] and out.new_blocks == [(0, 1, c_block)]
    assert list(s.waiting) == [b, c] and s.running == [a]  # the older of the two first
    for r in (b, c):
        assert (r.status, r.row, r.blocks, r.num_computed, r.num_preemptions) == (Status.WAITING, None, [], 0, 1)
    assert s.preemptions == 2
    s.blocks.free(held)
    read_back(s, out)
    out = s.schedule()  # readmitted in that order, each computing its prompt and token again
    # b's full block stayed in the prefix cache; c's was the one a took, so c computes it all.
    assert pieces(out) == [("a", 5, 1, True), ("b", 4, 1, True), ("c", 0, 5, True)]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (4, 0)


def test_a_request_preempted_for_itself_ends_the_step_and_nothing_is_admitted_after_it():
    s = scheduler(blocks=20, budget=64)
    a = request("a", [1] * 4)
    s.add(a)
    read_back(s, s.schedule())
    held = s.blocks.allocate(s.blocks.free_blocks)
    assert held is not None
    s.add(request("late", [9] * 2))
    out = s.schedule()
    assert out.preempted_ids == ["a"] and out.empty and [r.request_id for r in s.waiting] == ["a", "late"]


def test_a_step_that_preempts_admits_no_one_so_the_preempted_request_is_not_taken_back_at_once():
    s = scheduler(budget=5, max_num_seqs=2, caching=False)
    a, v = request("a", [1] * 4, max_tokens=100), request("v", [2] * 12, max_tokens=100)
    s.add(a)
    s.add(v)
    while v.num_output_tokens == 0:  # v's prompt in chunks of what a's piece leaves, then its first token
        read_back(s, s.schedule())
    held = s.blocks.allocate(s.blocks.free_blocks)
    assert held is not None
    for _ in range(2 * BLOCK):  # within a block's worth of decodes one of them needs a new block
        out = s.schedule()
        if out.preempted_ids:
            break
        read_back(s, out)
    # Its blocks and the budget left would let v back in for a chunk, to be preempted again next step.
    assert out.preempted_ids == ["v"] and [p.request_id for p in out.seqs] == ["a"] and list(s.waiting) == [v]


def test_a_prompt_that_starts_with_cached_blocks_computes_only_the_rest():
    s = scheduler(budget=64)
    prefix = list(range(100, 108))  # two full blocks
    first = request("first", [*prefix, 1, 2])
    s.add(first)
    read_back(s, s.schedule())  # its full blocks are registered once computed
    second = request("second", [*prefix, 3, 4, 5])
    s.add(second)
    out = s.schedule()
    assert pieces(out)[1] == ("second", 8, 3, True)
    assert second.blocks[:2] == first.blocks[:2] and second.num_cached_tokens == 8
    assert (s.blocks.stats.queried_tokens, s.blocks.stats.hit_tokens) == (10 + 11, 8)


def test_a_cached_prompt_still_computes_its_last_token_and_a_scored_prompt_takes_nothing_from_the_cache():
    s = scheduler(budget=64)
    prompt = list(range(100, 108))
    s.add(request("first", prompt))
    read_back(s, s.schedule())
    again = request("again", prompt)
    scored = request("scored", prompt, prompt_logprobs=1)
    s.add(again)
    s.add(scored)
    out = s.schedule()
    # The last token's logits are what a sample needs: the second block is computed, not shared.
    assert pieces(out)[1:] == [("again", 4, 4, True), ("scored", 0, 8, True)]
    assert (again.num_cached_tokens, scored.num_cached_tokens) == (4, 0)


def test_aborting_a_waiting_or_a_running_request_frees_what_it_held():
    s = scheduler(budget=64)
    running, waiting = request("running", [1] * 6), request("waiting", [2] * 3)
    s.add(running)
    read_back(s, s.schedule())
    s.add(waiting)
    s.finish(waiting, "abort")
    s.finish(running, "abort")
    for r in (running, waiting):
        assert (r.status, r.finish_reason, r.row, r.blocks) == (Status.FINISHED, "abort", None, [])
    assert not s.waiting and not s.running and s.schedule().empty
    assert s.blocks.check_empty() is None and sorted(s.free_rows) == list(range(8))


def test_a_step_launched_before_a_preemption_registers_nothing_for_the_request():
    s = scheduler(budget=8)
    r = request("r", list(range(100, 112)))
    s.add(r)
    stale = s.schedule()  # its first 8 positions, a chunk that does not sample
    written = list(r.blocks)
    s.preempt(r)  # before that step is read back
    again = s.schedule()  # readmitted at once on other blocks, which the stale step never wrote
    assert pieces(again) == [("r", 0, 8, False)] and not set(r.blocks) & set(written)
    read_back(s, stale)
    assert r.num_cached_blocks == 0 and not s.blocks.cached
    read_back(s, again)
    assert r.num_cached_blocks == 2  # the step of this admission registers them


def test_a_request_with_its_output_scheduled_is_not_scheduled_again():
    s = scheduler(budget=64)
    r = request("r", [1, 2, 3], max_tokens=1)
    s.add(r)
    out = s.schedule()
    assert pieces(out) == [("r", 0, 3, True)]
    assert s.schedule().empty  # its one token is on its way back: nothing more to compute


def test_the_output_names_requests_by_id_and_gives_a_new_row_once_with_copies_of_its_state():
    s = scheduler(budget=64)
    a = request("a", [1, 2, 3, 4], repetition_penalty=1.2)
    s.add(a)
    out = s.schedule()
    new = out.new_requests
    assert new == [NewRequest("a", 0, a.params, a.seed, (1, 2, 3, 4), (), tuple(a.blocks))]
    assert out.new_blocks == []  # a row given whole lists its blocks there, not again as appended ones
    assert [(p.request_id, p.row, p.token_ids, p.samples, p.output_index) for p in out.seqs] == [
        ("a", 0, [1, 2, 3, 4], True, 0)
    ]
    read_back(s, out, token=9)
    a.blocks.append(-1)  # the scheduler's lists change on; what it handed over does not
    assert new[0].block_ids == tuple(a.blocks[:-1])
    a.blocks.pop()
    out = s.schedule()  # the decode of position 4, whose token (9) the host has read back
    assert out.new_requests == [] and [(p.start, p.token_ids, p.output_index) for p in out.seqs] == [(4, [9], 1)]
    assert out.new_blocks == [(0, 1, a.blocks[1])]  # position 4 opens the row's second block


def test_a_readmitted_request_is_given_its_row_again_with_its_output_so_far():
    s = scheduler(blocks=4, budget=64, caching=False)  # 3 usable blocks of 4 tokens
    a, b = request("a", [1] * 4, max_tokens=8), request("b", [2] * 4, max_tokens=8)
    s.add(a)
    s.add(b)
    read_back(s, s.schedule(), token=5)  # each prompt fills its one block; each decode needs a second
    out = s.schedule()  # a takes the last free block; b, the newest, finds none and goes
    assert out.preempted_ids == ["b"]
    read_back(s, out, token=6)
    s.finish(a, "abort")
    out = s.schedule()
    assert [(n.request_id, n.prompt_token_ids, n.output_token_ids) for n in out.new_requests] == [
        ("b", (2, 2, 2, 2), (5,))
    ]
    assert out.seqs[0].token_ids == [2, 2, 2, 2, 5] and out.seqs[0].samples


def test_in_the_deterministic_mode_a_prompts_one_token_piece_is_no_decode_row_and_outputs_are_not_cached():
    """A prompt's last token alone (here the budget's remainder) runs where its prompt's other pieces ran,
    not as a decode row; and only prompt positions go into the prefix cache (an output's position was
    computed as a decode row, which a later prompt repeating it would not be)."""
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64, block_size=BLOCK, deterministic=True
    )
    s = Scheduler(config, 32)
    a = request("a", list(range(7)), max_tokens=8, ignore_eos=True)
    s.add(a)
    out = s.schedule()
    assert pieces(out) == [("a", 0, 6, False)] and out.singles == 0
    read_back(s, out)
    out = s.schedule()
    assert pieces(out) == [("a", 6, 1, True)] and out.singles == 0  # the prompt's: through the chunk path
    read_back(s, out)
    for _ in range(4):
        out = s.schedule()
        assert pieces(out)[0][2] == 1 and out.singles == 1  # decode rows
        read_back(s, out)
    assert a.num_cached_blocks == 1  # the prompt's one full block; its outputs filled another, not cached
    plain = Scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64, block_size=BLOCK), 32)
    plain.add(request("b", list(range(7)), max_tokens=8, ignore_eos=True))
    read_back(plain, plain.schedule())
    assert plain.schedule().singles == 1  # without the mode a one-token piece is a decode row


def test_a_deterministic_scheduler_warns_once_when_it_preempts_a_request_with_outputs(caplog):
    """The one case the mode does not cover (its outputs' positions computed again through the prompt's
    path) is said, once, not kept silent."""
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=BLOCK, deterministic=True
    )
    s = Scheduler(config, 32)
    a, b = request("a", [1] * 5, ignore_eos=True), request("b", [2] * 5, ignore_eos=True)
    for r in (a, b):
        s.add(r)
    read_back(s, s.schedule())
    with caplog.at_level("WARNING", logger="fp8route"):
        s.preempt(a)
        s.preempt(b)
    warnings = [r.getMessage() for r in caplog.records if "deterministic mode" in r.getMessage()]
    assert len(warnings) == 1 and "request a was preempted" in warnings[0] and "1 output positions" in warnings[0]


def drain(s: Scheduler, requests: list[Request]) -> int:
    """Run requests to their max_tokens through s; the most running at once."""
    for r in requests:
        s.add(r)
    most = 0
    while s.waiting or s.running:
        out = s.schedule()
        most = max(most, len(s.running))
        read_back(s, out)
        for r in [r for r in s.running if len(r.output_token_ids) >= r.max_tokens]:
            s.finish(r, "length")
    return most


def test_reserve_admission_holds_every_running_request_to_its_max_tokens_so_none_is_preempted():
    # 8 prompts of 4 tokens, 12 out each: 4 blocks a request over its life, a pool of 12 usable blocks.
    load = [[request(f"r{i}", [i + 1] * 4, max_tokens=12) for i in range(8)] for _ in range(2)]
    on_demand, reserve = scheduler(blocks=13, caching=False), scheduler(blocks=13, caching=False, admission="reserve")
    assert drain(on_demand, load[0]) > 3 and on_demand.preemptions > 0  # admitted on room now, then preempted
    assert drain(reserve, load[1]) == 3 and reserve.preemptions == 0  # 3 x 4 blocks: all the pool holds
    assert all(len(r.output_token_ids) == 12 for r in load[1])


def test_under_reserve_admission_a_request_alone_runs_though_its_max_tokens_outlast_the_pool():
    s = scheduler(blocks=5, caching=False, admission="reserve")
    lone = request("lone", [1] * 4, max_tokens=100)  # 26 blocks over its life, 4 in the pool
    s.add(lone)
    assert pieces(s.schedule()) == [("lone", 0, 4, True)]
