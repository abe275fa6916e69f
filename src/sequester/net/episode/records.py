"""What an episode's network did, for its trial's record; pure: the router's counters (its
``sent``, ``received`` and ``refused_hits`` sets, as ``nft -j`` lists them) joined with the
names the DNS responder answered for each address.

Bounded twice: the router counts at most :data:`~sequester.net.episode.ruleset.SET_SIZE`
destinations of each kind (``complete`` says whether one filled up), and the record keeps
the :data:`KEPT` largest of each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sequester.net.episode.ruleset import SET_SIZE

__all__ = ["KEPT", "traffic_record"]

KEPT = 256

Key = tuple[str, str, int]


def _elements(doc: Mapping[str, Any], name: str) -> tuple[dict[Key, tuple[int, int]], bool]:
    """``(address, protocol, port) -> (packets, bytes)`` of set ``name``, and whether it is full."""
    found: dict[Key, tuple[int, int]] = {}
    for item in doc.get("nftables", []):
        found_set = item.get("set") if isinstance(item, dict) else None
        if not isinstance(found_set, dict) or found_set.get("name") != name:
            continue
        for entry in found_set.get("elem", []) or []:
            elem = entry.get("elem") if isinstance(entry, dict) else None
            if not isinstance(elem, dict):
                continue
            concat = (elem.get("val") or {}).get("concat") if isinstance(elem.get("val"), dict) else None
            counter = elem.get("counter") or {}
            if not isinstance(concat, list) or len(concat) != 3 or not isinstance(counter, dict):
                continue
            address, protocol, port = concat
            try:
                found[(str(address), str(protocol), int(port))] = (int(counter["packets"]), int(counter["bytes"]))
            except (KeyError, TypeError, ValueError):
                continue
    return found, len(found) >= SET_SIZE


def _counter(doc: Mapping[str, Any], name: str) -> int:
    for item in doc.get("nftables", []):
        counter = item.get("counter") if isinstance(item, dict) else None
        if isinstance(counter, dict) and counter.get("name") == name:
            return int(counter.get("packets", 0))
    return 0


def traffic_record(listing: str, names: Mapping[str, Sequence[str]] = {}) -> dict[str, Any]:  # noqa: B006
    """The destinations reached (bytes and packets each way, the names they were looked up
    by) and the destinations refused (packets), largest first."""
    try:
        doc = json.loads(listing)
    except ValueError:
        return {"complete": False, "destinations": [], "refused": [], "note": "the router's counters were unreadable"}
    sent, sent_full = _elements(doc, "sent")
    received, received_full = _elements(doc, "received")
    refused, refused_full = _elements(doc, "refused_hits")
    destinations: list[dict[str, Any]] = []
    for key in sorted(set(sent) | set(received)):
        address, protocol, port = key
        out, back = sent.get(key, (0, 0)), received.get(key, (0, 0))
        destinations.append(
            {
                "address": address,
                "protocol": protocol,
                "port": port,
                "names": list(names.get(address, ())),
                "packets_out": out[0],
                "bytes_out": out[1],
                "packets_in": back[0],
                "bytes_in": back[1],
            }
        )
    destinations.sort(key=lambda d: (-(d["bytes_out"] + d["bytes_in"]), d["address"], d["port"]))
    refusals: list[dict[str, Any]] = [
        {"address": a, "protocol": p, "port": port, "names": list(names.get(a, ())), "packets": n}
        for (a, p, port), (n, _bytes) in refused.items()
    ]
    refusals.sort(key=lambda d: (-d["packets"], d["address"], d["port"]))
    return {
        "complete": not (sent_full or received_full or refused_full)
        and len(destinations) <= KEPT
        and len(refusals) <= KEPT,
        "destinations": destinations[:KEPT],
        "bytes_out": sum(d["bytes_out"] for d in destinations),
        "bytes_in": sum(d["bytes_in"] for d in destinations),
        "refused": refusals[:KEPT],
        "refused_packets": _counter(doc, "refused_packets"),
    }
