"""The wire protocol's envelopes and checks, and rendezvous placement over live members."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persisting import errors
from persisting.errors import PersistingError, ProtocolError
from persisting.service.protocol import (
    MAX_KEYS_PER_REQUEST,
    PROTOCOL_VERSION,
    error_reply,
    is_plain,
    make_request,
    ok_reply,
    parse_request,
    safe_loads,
    unwrap_reply,
)
from persisting.service.routing import Membership, group_by_owner, owner, rank_members


def test_request_round_trip_and_checks() -> None:
    message = make_request("contains", sid="s1", model="m/a", keys=["k"], touch=["t"])
    request = parse_request(pickle.loads(pickle.dumps(message)))
    assert (request.op, request.sid, request.model) == ("contains", "s1", "m/a")
    assert request.args == {"keys": ["k"], "touch": ["t"]}
    for moved in ("get", "put", "upload_part", "read_part"):  # values ride on data connections
        with pytest.raises(ProtocolError, match="unknown operation"):
            make_request(moved, sid="s1", model="m/a", keys=["k"])
    bad = [
        ("not a dict", "must be a dict"),
        ({**message, "v": PROTOCOL_VERSION + 1}, "version"),
        ({**message, "op": "drop_everything"}, "unknown operation"),
        ({k: v for k, v in message.items() if k != "keys"}, "missing keys"),
        ({**message, "model": None}, "needs a model"),
        ({**message, "keys": "k"}, "must be a list"),
        ({**message, "keys": [1]}, "must be strings"),
        ({**message, "keys": ["k"] * (MAX_KEYS_PER_REQUEST + 1)}, "limit"),
        ({**message, "touch": [1]}, "touch must be"),
    ]
    for value, match in bad:
        with pytest.raises(ProtocolError, match=match):
            parse_request(value)


def test_every_error_comes_back_as_its_own_type() -> None:
    classes = [getattr(errors, name) for name in errors.__all__ if name != "error_class_for"]
    for cls in classes:
        reply = pickle.loads(pickle.dumps(error_reply(cls("boom"))))
        with pytest.raises(cls, match="boom") as info:
            unwrap_reply(reply)
        assert type(info.value) is cls
    with pytest.raises(PersistingError, match="ValueError: plain"):
        unwrap_reply(error_reply(ValueError("plain")))
    assert unwrap_reply(ok_reply({"x": [1, b"2"]})) == {"x": [1, b"2"]}
    with pytest.raises(ProtocolError):
        unwrap_reply({"v": 0, "ok": True})


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("pwned",))


def test_replies_are_decoded_without_trusting_the_sender() -> None:
    plain = {"a": [1, 2.5, "x", b"y", None, True, (1, 2)]}
    assert safe_loads(pickle.dumps(plain)) == plain
    assert is_plain(plain)
    for hostile in (_Evil(), bytearray(b"x"), Counter("ab")):
        assert not is_plain(hostile)
        with pytest.raises(ProtocolError, match="refusing"):
            safe_loads(pickle.dumps(hostile))
    assert not is_plain({1, 2})  # harmless to decode, but not part of the protocol
    with pytest.raises(ProtocolError, match="undecodable"):
        safe_loads(b"\x80\x04garbage")


def test_rendezvous_spreads_keys_and_is_deterministic() -> None:
    members = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
    keys = [f"m@1@0@{i:x}@bfloat16" for i in range(3000)]
    counts = Counter(owner(k, members) for k in keys)
    assert set(counts) == set(members)
    assert min(counts.values()) > 800  # ~1000 each
    assert [owner(k, list(reversed(members))) for k in keys] == [owner(k, members) for k in keys]
    assert owner("k", []) is None
    groups = group_by_owner(keys[:50], members)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(50))


@settings(max_examples=50, deadline=None)
@given(
    members=st.sets(st.integers(1, 60), min_size=2, max_size=8),
    keys=st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=60),
    data=st.data(),
)
def test_losing_a_member_moves_only_its_own_keys(members, keys, data) -> None:
    names = [f"10.0.0.{m}:8610" for m in sorted(members)]
    gone = data.draw(st.sampled_from(names))
    rest = [m for m in names if m != gone]
    for key in keys:
        before = owner(key, names)
        after = owner(key, rest)
        if before != gone:
            assert after == before
        else:
            assert after == rank_members(key, names)[1]  # its second choice


def test_membership_leaves_failed_members_out_until_a_probe_succeeds() -> None:
    now = [0.0]
    members = Membership(retry_s=2.0, clock=lambda: now[0])
    members.update(["a", "b", "c"])
    members.mark_down("b")
    assert members.live == ["a", "c"]
    assert members.known == ["a", "b", "c"]
    assert members.probes_due() == []
    now[0] = 2.0
    assert members.probes_due() == ["b"]
    assert members.probes_due() == []  # rescheduled
    assert not members.is_live("b")  # still down: only a successful probe brings it back
    members.mark_up("b")
    assert members.live == ["a", "b", "c"]
    members.mark_down("c")
    members.update(["a", "b"])
    assert members.live == ["a", "b"] and not members.is_live("c")
    now[0] = 10.0
    assert members.probes_due() == []  # c was forgotten with its probe
