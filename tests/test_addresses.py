"""parse_host_port: HOST and PORT of every form of address the project writes, and one error for the rest that
names where the address came from, the address and a form that works."""

import pytest

from heterorl.addresses import parse_host_port
from heterorl.errors import ConfigError


@pytest.mark.parametrize("address, host, port", [
    ("127.0.0.1:8765", "127.0.0.1", 8765),
    ("tcp://10.0.0.7:0", "10.0.0.7", 0),
    ("tcp://*:5555", "*", 5555),
    ("ray://head.example:10001", "head.example", 10001),
    ("http://localhost:80", "localhost", 80),
    ("tcp://[::1]:5556", "[::1]", 5556),  # brackets kept: f"tcp://{host}:{port}" is an address again
])
def test_every_form_gives_its_host_and_port(address, host, port):
    assert parse_host_port(address, "--bind", "127.0.0.1:8765") == (host, port)


@pytest.mark.parametrize("address", ["127.0.0.1", "tcp://127.0.0.1:", "tcp://:5555", "tcp://host:http",
                                     "ipc:///tmp/learner", ":"])
def test_an_address_without_a_host_or_a_numeric_port_is_refused_naming_it_and_the_fix(address):
    with pytest.raises(ConfigError) as info:
        parse_host_port(address, "--address", "HEAD:6379")
    assert str(info.value) == (f"--address {address!r} is not HOST:PORT with a numeric port: give one such as "
                               "HEAD:6379")
