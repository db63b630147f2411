"""The configuration reference names every store URL parameter the code takes, and nothing else;
and a tier refuses a parameter it does not take."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvrag.errors import StoreError
from kvrag.stores import COMMON_PARAMS, disk, memory, open_store
from kvrag.stores.redis import url as redis_url

PAGE = Path(__file__).parents[2] / "docs" / "reference" / "configuration.md"


def test_the_page_names_every_store_url_parameter_and_no_other():
    table = PAGE.read_text().split("## Store URL parameters", 1)[1]
    documented = {name for cell in re.findall(r"^\|[^|]*\| ([^|]*) \|", table, re.M) for name in re.findall(r"`(\w+)`", cell)}
    taken = {*COMMON_PARAMS, *memory.PARAMS, *disk.PARAMS, *redis_url.PARAMS, "ssl", "socket_timeout",
             "socket_connect_timeout", *redis_url.CLUSTER_TLS_PARAMS}
    assert documented - {"parameter"} == taken


@pytest.mark.parametrize("url", ["memory://?max_gib=1", "disk:///tmp/kvrag-x?max_mib=1", "memory://?colour=red",
                                 "redis+cluster://127.0.0.1:7000?colour=red"])
def test_a_parameter_the_tier_does_not_take_is_an_error_naming_it(url):
    with pytest.raises(StoreError, match=r"max_gib|max_mib|colour"):
        open_store(url)
