"""eagle_serve.server.launch's choice of ports for the servers it starts."""
import socket

from eagle_serve.server import launch
from eagle_serve.server.launch import FIRST_PORT, bound_ports, ephemeral_ports, free_ports


def test_free_ports_are_distinct_free_and_below_the_ephemeral_range():
    """(an outgoing connection could be given a port from that range before a server binds it)"""
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(FIRST_PORT <= port < ephemeral_ports().start for port in ports)
    assert bound_ports(ports) == ports


def test_a_port_in_use_is_never_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        busy = taken.getsockname()[1]
        assert bound_ports([busy]) == []
        picks = iter([busy, busy, FIRST_PORT + 17])
        monkeypatch.setattr(launch.random, "randrange", lambda *_: next(picks))
        monkeypatch.setattr(launch, "ephemeral_ports", lambda: range(busy + 1, busy + 2))
        assert free_ports(1) == [FIRST_PORT + 17]
