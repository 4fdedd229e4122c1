"""The one-machine transport (engine/channel.PipeChannel): control objects and streams larger than a pipe's
buffer arrive whole and in order; a peer that went away is a RuntimeError naming it, not a hang."""

from __future__ import annotations

import pytest
import torch

from leanserve.engine.channel import PIPE_BYTES, Links, PipeChannel


@pytest.fixture
def pair():
    links = Links.create(2)
    channels = PipeChannel(links[0]), PipeChannel(links[1])
    yield *channels, links
    for channel in channels:
        channel.close()


def test_streams_larger_than_the_pipe_arrive_whole_and_in_order(pair):
    first, second, _ = pair
    big = torch.randn(3 * PIPE_BYTES // (4 * 4 * 64) + 1, 4, 64)  # (more than three pipe buffers)
    small = torch.randn(2, 4, 64).to(torch.bfloat16)
    plan = {"step": 1, "ids": list(range(300000))}  # (a pickle larger than a pipe buffer too)
    # Nothing reads yet: every post returns all the same (what the pipes do not hold waits for the sender).
    first.post_obj(plan, 1)
    first.post_streams(big, 1)
    first.post_streams(small, 1)
    mailbox = second.mailbox(0)
    assert mailbox.take() == plan
    got_big, got_small = torch.empty_like(big), torch.empty_like(small)
    second.recv_streams(got_big, 0).wait()
    second.recv_streams(got_small, 0).wait()
    assert torch.equal(got_big, big) and torch.equal(got_small, small)
    assert not mailbox.ready()


def test_two_stages_that_both_send_more_than_a_pipe_holds_before_reading_do_not_wait_on_each_other(pair):
    first, second, _ = pair
    plan, tokens = list(range(300000)), list(range(300000, 600000))
    first.post_obj(plan, 1)  # (stage 0's next plan, while the last stage sends its tokens)
    second.post_obj(tokens, 0)
    assert second.mailbox(0).take() == plan
    assert first.mailbox(1).take() == tokens


def test_a_streams_size_other_than_the_plans_is_refused(pair):
    first, second, _ = pair
    first.post_streams(torch.zeros(3, 4), 1)
    with pytest.raises(RuntimeError, match="48 bytes of streams where 32 were expected"):
        second.recv_streams(torch.empty(2, 4), 0).wait()


def test_a_peer_that_went_away_is_an_error_naming_it(pair):
    first, second, links = pair
    links[1].close()  # stage 1 is gone: its ends are closed
    with pytest.raises(RuntimeError, match="Connection closed by stage 1"):
        first.post_obj("plan", 1)
    with pytest.raises(RuntimeError, match="Connection closed by stage 1"):
        first.mailbox(1).take()
