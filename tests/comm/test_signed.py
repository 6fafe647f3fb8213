"""lightning_zero.comm.signed: signed frames, and what silent, lying and closed peers do to the transport (3 real
processes each)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.signed import (
    HEADER,
    MAGIC,
    SIGNATURE_BYTES,
    Evidence,
    PeerGone,
    PeerMisbehaved,
    PeerTimeout,
    SignedTransport,
    sign_frame,
    verify_evidence,
)
from tests.helpers.workers import run_workers

ed25519 = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ed25519")
MAX_BYTES = 1024


def _evidence(frame: bytes) -> Evidence:
    import hashlib

    header, payload, signature = frame[: HEADER.size], frame[HEADER.size : -SIGNATURE_BYTES], frame[-SIGNATURE_BYTES:]
    return Evidence(header, hashlib.sha256(payload).digest(), signature)


def _raw_public(key) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def test_a_frame_proves_its_sender_and_nothing_else():
    key, other = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    frame = sign_frame(key, 2, 0, 7, 3, b"rows")
    evidence = _evidence(frame)
    assert evidence.fields == (2, 0, 7, 3, 4)
    assert verify_evidence(_raw_public(key), evidence)
    assert not verify_evidence(_raw_public(other), evidence)
    tampered = Evidence(evidence.header, _evidence(sign_frame(key, 2, 0, 7, 3, b"rowz")).digest, evidence.signature)
    assert not verify_evidence(_raw_public(key), tampered)


def test_bad_settings_are_refused_with_the_numbers():
    store = dist.HashStore()
    with pytest.raises(ValueError, match=r"rank=3 is invalid: expected 0 <= rank < world_size=3"):
        SignedTransport(3, 3, store)
    with pytest.raises(ValueError, match=r"timeout_s=0 is invalid"):
        SignedTransport(0, 1, store, timeout_s=0)
    with pytest.raises(ValueError, match=r"max_message_bytes=-1 is invalid"):
        SignedTransport(0, 1, store, max_message_bytes=-1)


def _wait_count(store, name: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while int(store.add(name, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: fewer than {count} ranks after 30 s")
        time.sleep(0.01)


def _barrier(store, name: str, world: int) -> None:
    """Every rank in, then every rank out: rank 0 hosts the store and must leave last."""
    store.add(name, 1)
    _wait_count(store, name, world)
    store.add(f"{name}/out", 1)
    if int(os.environ["RANK"]) == 0:
        _wait_count(store, f"{name}/out", world)


def _scenario(case: str) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=rank == 0, timeout=timedelta(seconds=30)
    )
    comm.LEDGER.reset()
    # Deadlines far above any scheduling delay of a loaded CI machine; the slow case sets its own.
    transport = SignedTransport(rank, world, store, timeout_s=30.0, max_message_bytes=MAX_BYTES)
    _barrier(store, "ready", world)  # every rank connected to every other before any case starts
    out: dict = {}
    try:
        if case == "honest":
            for step in range(3):
                for peer in range(world):
                    if peer != rank:
                        transport.send(peer, step, 5, f"{rank}->{peer}@{step}".encode(), tag="rows")
            out["got"] = {
                (peer, step): transport.recv(peer, step, 5).decode()
                for step in range(3)
                for peer in range(world)
                if peer != rank
            }
            out["ledger"] = comm.LEDGER.summary()
        elif case == "slow":
            if rank == 1:
                _wait_count(store, "timed_out", 1)  # only after rank 0's first deadline passed
                transport.send(0, 0, 0, b"late")
            elif rank == 0:
                start = time.monotonic()
                with pytest.raises(PeerTimeout, match=r"no message from rank 1 for step 0, phase 0 within 0.5 s"):
                    transport.recv(1, 0, 0, timeout=0.5)
                out["timed_out_after"] = time.monotonic() - start
                store.add("timed_out", 1)
                out["late"] = transport.recv(1, 0, 0, timeout=60)  # the connection survived the timeout
        elif case == "lying":
            key = transport._key  # the attacks write frames by hand
            if rank == 1:  # to rank 0: a replay, then two different signed messages for one key
                first = sign_frame(key, 1, 0, 0, 0, b"a")
                transport._out[0].sendall(first + first + sign_frame(key, 1, 0, 0, 0, b"b"))
                transport.send(0, 1, 0, b"after")
                # to rank 2: a frame whose signature is wrong
                bad = bytearray(sign_frame(key, 1, 2, 0, 0, b"x"))
                bad[-1] ^= 1
                transport._out[2].sendall(bytes(bad))
            elif rank == 2:  # to rank 0: a frame announcing more than it may carry
                header = HEADER.pack(MAGIC, 2, 0, 0, 0, 10**9)
                transport._out[0].sendall(header)
                with pytest.raises(PeerGone, match=r"rank 1 is unreachable or faulty: it sent a bad signature"):
                    transport.recv(1, 0, 0)
                out["from_0"] = transport.recv(0, 0, 9)  # honest traffic goes on
            else:
                # recv(1, 0, 0) would give b"a" or the proof, whichever it finds first: ask for the frame after both
                with pytest.raises(PeerMisbehaved, match="rank 1 signed two different messages for step 0") as info:
                    transport.recv(1, 1, 0)
                proof = info.value.evidence
                out["proof_valid"] = [verify_evidence(transport.public_keys[1], e) for e in proof]
                out["proof_digests_differ"] = proof[0].digest != proof[1].digest
                out["replays"] = transport.replays
                with pytest.raises(PeerGone, match=r"announcing 1000000000 bytes, more than max_message_bytes=1024"):
                    transport.recv(2, 0, 0)
                transport.send(2, 0, 9, b"still here")
        elif case == "closed":
            if rank == 1:
                transport.send(0, 0, 0, b"last words")
                _barrier(store, "sent", 2)
                transport.close()  # what a crash does to the sockets: the kernel closes them
            elif rank == 0:
                _barrier(store, "sent", 2)
                out["last"] = transport.recv(1, 0, 0)  # delivered before the close
                start = time.monotonic()
                with pytest.raises(PeerGone, match="rank 1 is unreachable or faulty: connection closed"):
                    transport.recv(1, 1, 0, timeout=60)
                out["gone_after"] = time.monotonic() - start
        _barrier(store, "done", world)
    finally:
        transport.close()
    return out


def test_honest_ranks_exchange_signed_messages_counted_in_the_ledger():
    results = run_workers(_scenario, 3, "honest")
    for rank, result in enumerate(results):
        peers = [p for p in range(3) if p != rank]
        assert result["got"] == {(p, s): f"{p}->{rank}@{s}" for s in range(3) for p in peers}
        calls, nbytes = result["ledger"][("signed_send", "rows")]
        payloads = sum(len(f"{rank}->{p}@{s}") for s in range(3) for p in peers)
        assert calls == 6 and nbytes == payloads + 6 * (HEADER.size + SIGNATURE_BYTES)


def test_a_peer_slower_than_the_deadline_times_out_and_is_still_heard_later():
    result = run_workers(_scenario, 3, "slow")[0]
    assert 0.5 <= result["timed_out_after"] < 10.0
    assert result["late"] == b"late"


def test_lying_peers_are_caught_and_the_honest_rank_goes_on():
    results = run_workers(_scenario, 3, "lying")
    assert results[0]["proof_valid"] == [True, True] and results[0]["proof_digests_differ"]
    assert results[0]["replays"] == 1
    assert results[2]["from_0"] == b"still here"


def test_a_closed_peer_is_gone_at_once_after_what_it_sent():
    result = run_workers(_scenario, 3, "closed")[0]
    assert result["last"] == b"last words"
    assert result["gone_after"] < 10.0  # not the 60 s deadline
