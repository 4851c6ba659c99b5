"""Value kinds of ``vocable serve`` options: each turns the text of a flag or a ``VOCABLE_*``
variable into its typed value, or raises ValueError with a message saying what is wanted.

Typed values (``ServeOptions(port=8080)`` from Python) pass through unchanged."""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import BeforeValidator, PlainValidator

from .llm import ConfigError

__all__ = [
    "DEFAULT_HOST",
    "Address",
    "BaseUrl",
    "IceUrls",
    "Nameserver",
    "Networks",
    "Number",
    "PortRange",
    "ReadWhole",
    "RedisUrl",
    "Switch",
    "Text",
    "Texts",
    "Whole",
    "format_port_range",
    "parse_address",
    "parse_port_range",
    "split_list",
]

DEFAULT_HOST = "127.0.0.1"
"""Where the server listens when a flag names no host: this machine only."""

SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True}
SWITCH_WORDS |= {"0": False, "false": False, "no": False, "off": False}
ICE_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")


def split_list(text: str) -> list[str]:
    """A comma-separated variable's items, blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_port_range(text: str) -> tuple[int, int]:
    """``LOW-HIGH`` -> (low, high + 1), a range of at least one even/odd pair; raises
    ConfigError."""
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        raise ConfigError(f"{text!r} is not LOW-HIGH") from None
    if not 1024 <= first < last <= 65535:
        raise ConfigError(f"{text!r}: need 1024 <= LOW < HIGH <= 65535")
    return first, last + 1


def format_port_range(ports: tuple[int, int]) -> str:
    """The ``LOW-HIGH`` text :func:`parse_port_range` reads back as ``ports``."""
    return f"{ports[0]}-{ports[1] - 1}"


def parse_address(text: str, default_host: str = DEFAULT_HOST) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` -> (host, port); raises ConfigError."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{text!r} is not HOST:PORT") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{text!r}: port out of range")
    return (host.strip("[]") or default_host), number


def _whole(value: Any) -> Any:
    # int() as argparse's type=int did: pydantic alone would also take "1.0"
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a whole number") from None
    return value


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a number") from None
    return value


def _switch(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return SWITCH_WORDS[value.lower()]
        except KeyError:
            raise ValueError(
                f"must be 1, true, yes, on or 0, false, no, off, not {value!r}"
            ) from None
    return value


def _text(value: Any) -> Any:
    return value or None  # an empty flag or variable is no value


def _items(value: Any) -> Any:
    return split_list(value) if isinstance(value, str) else tuple(value)


def _ice_urls(value: Any) -> tuple[str, ...]:
    urls = tuple(str(url) for url in _items(value))
    for url in urls:
        if not url.lower().startswith(ICE_SCHEMES):
            raise ValueError(f"{url!r} is not a stun:, stuns:, turn: or turns: URL")
    return urls


def _networks(value: Any) -> tuple[IPv4Network | IPv6Network, ...]:
    items: Iterable[Any] = _items(value)
    return tuple(ip_network(item, strict=False) for item in items)


def _address(value: Any) -> tuple[str, int] | None:
    if not value:
        return None
    if isinstance(value, str):
        return parse_address(value)
    host, port = value
    return str(host), int(port)


def _nameserver(value: Any) -> tuple[str, int] | None:
    if not value:
        return None
    if not isinstance(value, str):
        host, port = value
        return str(host), int(port)
    host, port_text = value, "53"
    if value.startswith("["):
        host, _, tail = value[1:].partition("]")
        port_text = tail.removeprefix(":") or "53"
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    try:
        ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address with an optional :PORT") from None
    if not (port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"bad port in {value!r}")
    return host, int(port_text)


def _port_range(value: Any) -> tuple[int, int]:
    if isinstance(value, str):
        return parse_port_range(value)
    low, high = value
    return int(low), int(high)


def _base_url(value: Any) -> str | None:
    if not value:
        return None
    url = str(value)
    if not url.startswith(("http://", "https://")):
        # the URL itself is not echoed: it may carry credentials
        raise ValueError("must be an http:// or https:// base URL, like http://host:8000/v1")
    return url.rstrip("/")


def _redis_url(value: Any) -> str | None:
    if not value:
        return None
    url = str(value)
    parsed = urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if (
        parsed.scheme not in ("redis", "rediss", "unix")
        or port == -1
        or (parsed.scheme != "unix" and not parsed.hostname)
    ):
        # the URL itself is not echoed: it may carry a password
        raise ValueError(
            "must be a redis://[:PASSWORD@]HOST[:PORT][/DB], rediss:// (TLS) or unix:// URL"
        )
    return url


ReadWhole = BeforeValidator(_whole)
"""Text to int, for int types other than :data:`Whole` (a Literal of numbers)."""
Whole = Annotated[int, ReadWhole]
Number = Annotated[float, BeforeValidator(_number)]
"""A float; ``inf`` passes, ``nan`` fails any bound."""
Switch = Annotated[bool, BeforeValidator(_switch)]
"""A store_true flag, or 1/true/yes/on and 0/false/no/off (any case) in the environment."""
Text = Annotated[str | None, BeforeValidator(_text)]
Texts = Annotated[tuple[str, ...], BeforeValidator(_items)]
IceUrls = Annotated[tuple[str, ...], PlainValidator(_ice_urls)]
Networks = Annotated[tuple[IPv4Network | IPv6Network, ...], PlainValidator(_networks)]
"""CIDR networks; a bare address is its /32 (/128), host bits are dropped."""
Address = Annotated[tuple[str, int] | None, PlainValidator(_address)]
Nameserver = Annotated[tuple[str, int] | None, PlainValidator(_nameserver)]
"""``[HOST:]PORT`` -> (host, port), host default :data:`DEFAULT_HOST`; empty: None."""
PortRange = Annotated[tuple[int, int], PlainValidator(_port_range)]
"""``LOW-HIGH`` -> (low, high + 1)."""
BaseUrl = Annotated[str | None, PlainValidator(_base_url)]
"""An http(s) base URL without its trailing slash; empty: None."""
RedisUrl = Annotated[str | None, PlainValidator(_redis_url)]
"""A Redis URL (``redis://``, ``rediss://``, ``unix://``); empty: None."""
