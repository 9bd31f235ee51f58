"""Cursor pagination of the admin API's lists (issue #26): the pure paging core, then whole
walks through real gateways (limits, ends, refusals, writes between pages, roles, one store
read per version, Redis replicas) and the CLI that follows ``next_cursor``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway import tenants_cli
from gateway.config import TenantEntry, TenantsFile
from gateway.errors import BadRequest
from gateway.paging import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    Kind,
    PageQuery,
    Position,
    decode_cursor,
    encode_cursor,
    page,
    page_query,
)
from tests.policies.conftest import RedisServer

from .conftest import TEST_KEY, ThreadedGateway, config_for
from .fake_backend import FakeBackend
from .test_admin import OPERATOR, Admin, error, file_tenants, replica
from .test_admission import with_store

# ---- the paging core ---------------------------------------------------------------------------


def test_a_cursor_round_trips_and_is_opaque_url_safe_text() -> None:
    cases: list[tuple[Kind, Position]] = [
        ("tenants", ("acme",)), ("tenants", ("a.b-c_9" * 9,)),
        ("keys", (1796030499, "key_9bdfa36b74878b46")), ("keys", (0, ""))]
    for kind, position in cases:
        cursor = encode_cursor(kind, position)
        assert cursor.isascii() and "=" not in cursor
        assert all(c.isalnum() or c in "-_" for c in cursor)
        assert decode_cursor(kind, cursor) == position


@pytest.mark.parametrize("cursor", [
    "", "!!!", "a", "é", "acme",  # not base64url of JSON
    encode_cursor("keys", (1, "key_0")),  # the other list's
    encode_cursor("tenants", (1,)), encode_cursor("tenants", ("a", "b")),
    encode_cursor("keys", (True, "key_0")), encode_cursor("keys", (1.5, "key_0")),
    encode_cursor("keys", ("1", "key_0")),
    "W10", "e30", "bnVsbA",  # [], {}, null
    encode_cursor("tenants", ("x" * 600,)),  # longer than any cursor this API makes
])
def test_a_cursor_not_made_by_this_list_is_refused_naming_cursor(cursor: str) -> None:
    with pytest.raises(BadRequest) as caught:
        decode_cursor("tenants", cursor)
    assert caught.value.param == "cursor" and caught.value.code == "invalid_value"


def test_limit_and_the_query_string() -> None:
    assert page_query([], "tenants") == PageQuery(DEFAULT_LIMIT, None)
    assert page_query([("limit", "1")], "keys") == PageQuery(1, None)
    assert page_query([("limit", str(MAX_LIMIT))], "keys").limit == MAX_LIMIT
    cursor = encode_cursor("tenants", ("m",))
    assert page_query([("cursor", cursor), ("limit", "7")], "tenants") == PageQuery(7, ("m",))
    for bad in ("0", "-1", str(MAX_LIMIT + 1), "", " 5", "5.0", "1e2", "abc", "٣",
                "9" * 5000):
        with pytest.raises(BadRequest) as caught:
            page_query([("limit", bad)], "tenants")
        assert caught.value.param == "limit", bad
    for params, named in [([("after", "a")], "after"), ([("limit", "1"), ("limit", "2")],
                                                         "limit"),
                          ([("cursor", cursor), ("cursor", cursor)], "cursor")]:
        with pytest.raises(BadRequest) as caught:
            page_query(params, "tenants")
        assert caught.value.param == named


def walk_core(items: list[str], limit: int, hidden: frozenset[str] = frozenset()
              ) -> list[list[str]]:
    pages: list[list[str]] = []
    query = PageQuery(limit, None)
    while True:
        got = page("tenants", query, items, lambda t: (t,),
                   lambda t: None if t in hidden else {"id": t})
        body = got.body()
        ids = [d["id"] for d in body["data"]]
        pages.append(ids)
        assert body["first_id"] == (ids[0] if ids else None)
        assert body["last_id"] == (ids[-1] if ids else None)
        assert (body["next_cursor"] is None) == (not body["has_more"])
        if not got.has_more:
            return pages
        assert len(ids) == limit
        query = PageQuery(limit, decode_cursor("tenants", body["next_cursor"]))


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 6, 100])
def test_the_core_walk_returns_every_shown_item_once_in_order(limit: int) -> None:
    items = ["a", "b", "c", "d", "e", "f"]
    pages = walk_core(items, limit)
    assert [i for p in pages for i in p] == items
    assert all(pages), "no empty page, not even the last: has_more is exact"
    # items the renderer refuses are skipped; has_more looks past refused ones at the end
    pages = walk_core(items, limit, frozenset({"b", "e", "f"}))
    assert [i for p in pages for i in p] == ["a", "c", "d"] and all(pages)
    assert walk_core([], limit) == [[]]


# ---- through a gateway -----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def operator_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_ADMIN_KEY", OPERATOR)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeBackend]:
    with FakeBackend() as f:
        yield f


@pytest.fixture
def gw(fake: FakeBackend) -> Iterator[ThreadedGateway]:
    with ThreadedGateway(config_for(fake.url), file_tenants()) as g:
        yield g


def get_page(admin: Admin, path: str = "", **params: Any) -> dict[str, Any]:
    r = httpx.get(admin.base + path, params=params, headers=admin.headers, timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert set(body) == {"object", "data", "has_more", "first_id", "last_id", "next_cursor"}
    assert body["object"] == "list"
    assert (body["next_cursor"] is None) == (body["has_more"] is False)
    ids = [d["id"] for d in body["data"]]
    assert (body["first_id"], body["last_id"]) == ((ids[0], ids[-1]) if ids else (None, None))
    return body


def walk(admin: Admin, path: str = "", limit: int | None = None) -> list[list[str]]:
    """Every page's ids, following next_cursor; checks each page against the limit."""
    params: dict[str, Any] = {} if limit is None else {"limit": limit}
    pages: list[list[str]] = []
    while True:
        body = get_page(admin, path, **params)
        pages.append([d["id"] for d in body["data"]])
        if not body["has_more"]:
            return pages
        assert len(pages[-1]) == (limit or DEFAULT_LIMIT)
        params["cursor"] = body["next_cursor"]


def ids(pages: list[list[str]]) -> list[str]:
    return [i for p in pages for i in p]


def test_walking_every_page_returns_each_tenant_once_in_order(gw: ThreadedGateway) -> None:
    op = Admin(gw)
    made = ["t05", "t01", "t-3", "T9", "t.2", "z", "a_b"]
    for tid in made:
        assert op("POST", "", {"id": tid}).status_code == 201
    everyone = sorted([*made, "one"])
    n = len(everyone)
    for limit in (None, 1, 2, 3, n - 1, n, n + 1, MAX_LIMIT):
        pages = walk(op, limit=limit)
        assert ids(pages) == everyone, limit
        assert len(pages) == -(-n // (limit or DEFAULT_LIMIT)), limit  # no empty last page
    whole = get_page(op, limit=n)
    assert whole["has_more"] is False and whole["next_cursor"] is None
    assert whole["data"][0] == op("GET", "/" + everyone[0]).json()  # whole records


def test_the_default_limit_is_a_page_and_next_cursor_walks_the_rest(
        fake: FakeBackend) -> None:
    many = TenantsFile(tenants=[TenantEntry(id=f"t{i:04d}") for i in range(DEFAULT_LIMIT + 31)])
    with ThreadedGateway(config_for(fake.url), many) as g:
        op = Admin(g)
        first = get_page(op)
        assert len(first["data"]) == DEFAULT_LIMIT and first["has_more"] is True
        assert ids(walk(op)) == [t.id for t in many.tenants]
        assert len(get_page(op, limit=MAX_LIMIT)["data"]) == DEFAULT_LIMIT + 31


def test_the_ends_and_every_refusal(gw: ThreadedGateway) -> None:
    op = Admin(gw)
    past = get_page(op, cursor=encode_cursor("tenants", ("zzzz",)))
    assert past["data"] == [] and past["has_more"] is False
    assert (past["first_id"], past["last_id"], past["next_cursor"]) == (None, None, None)
    last = get_page(op, limit=1)  # "one" is the only tenant
    assert last["has_more"] is False and last["next_cursor"] is None
    assert get_page(op, "/one/keys", cursor=encode_cursor("keys", (2**40, "key_z")))["data"] == []

    for path in ("", "/one/keys"):
        for params, named in [({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"),
                              ({"limit": "ten"}, "limit"), ({"cursor": "!!"}, "cursor"),
                              ({"cursor": ""}, "cursor"), ({"after": "one"}, "after")]:
            r = httpx.get(op.base + path, params=params, headers=op.headers, timeout=10)
            err = error(r, 400, named)
            assert named in err["message"]
    # a cursor of the other list is not one of this list
    error(httpx.get(op.base + "/one/keys", headers=op.headers, timeout=10,
                    params={"cursor": encode_cursor("tenants", ("one",))}), 400, "cursor")
    error(httpx.get(op.base, headers=op.headers, timeout=10,
                    params={"cursor": encode_cursor("keys", (1, "key_0"))}), 400, "cursor")
    error(httpx.get(op.base + "/ghost/keys", params={"limit": 1}, headers=op.headers,
                    timeout=10), 404, "tenant")


def test_writes_between_pages_never_repeat_or_skip_an_untouched_tenant(
        gw: ThreadedGateway) -> None:
    op = Admin(gw)
    for tid in ("b", "d", "f", "h", "j", "l"):
        assert op("POST", "", {"id": tid}).status_code == 201
    first = get_page(op, limit=3)
    assert [t["id"] for t in first["data"]] == ["b", "d", "f"]
    # the cursor's own tenant and one already seen go, one not yet seen goes, two come:
    # one before the cursor (this walk is past it) and one after it
    for tid in ("f", "b", "j"):
        assert op("DELETE", "/" + tid).status_code == 200
    for tid in ("c", "k"):
        assert op("POST", "", {"id": tid}).status_code == 201
    assert walk_from(op, first["next_cursor"], 2) == ["h", "k", "l", "one"]


def walk_from(admin: Admin, cursor: str, limit: int, path: str = "") -> list[str]:
    out: list[str] = []
    params: dict[str, Any] = {"limit": limit, "cursor": cursor}
    while True:
        body = get_page(admin, path, **params)
        out += [d["id"] for d in body["data"]]
        if not body["has_more"]:
            return out
        params["cursor"] = body["next_cursor"]


def test_keys_page_the_same_way(gw: ThreadedGateway) -> None:
    op = Admin(gw)
    assert op("POST", "", {"id": "a"}).status_code == 201
    made = [op("POST", "/a/keys", {"role": role}).json() for role in
            ("user", "tenant_admin", "user", "user", "user", "user")]
    whole = get_page(op, "/a/keys", limit=MAX_LIMIT)["data"]
    order = [k["id"] for k in whole]
    assert sorted(order) == sorted(k["id"] for k in made)
    assert [(k["created"], k["id"]) for k in whole] == sorted((k["created"], k["id"])
                                                              for k in whole)
    assert all(set(k) == {"id", "role", "created"} for k in whole)  # never a digest or key
    for limit in (None, 1, 2, 5, 6, 7):
        assert ids(walk(op, "/a/keys", limit)) == order, limit

    first = get_page(op, "/a/keys", limit=2)
    gone, kept_after = order[1], order[3]  # the cursor's own key, and one ahead
    assert op("DELETE", f"/a/keys/{order[4]}").status_code == 200
    assert op("DELETE", f"/a/keys/{gone}").status_code == 200
    new = op("POST", "/a/keys").json()  # created now: its place is (created, random id)
    rest = walk_from(op, first["next_cursor"], 1, "/a/keys")
    assert kept_after in rest and len(rest) == len(set(rest))
    assert set(rest) - {new["id"]} == {order[2], order[3], order[5]}
    cursor_at = (whole[1]["created"], whole[1]["id"])
    assert (new["id"] in rest) == ((new["created"], new["id"]) > cursor_at)


def test_roles_are_unchanged_by_paging(gw: ThreadedGateway) -> None:
    op = Admin(gw)
    for tid in ("a", "b", "c"):
        assert op("POST", "", {"id": tid}).status_code == 201
    ta = Admin(gw, op("POST", "/b/keys", {"role": "tenant_admin"}).json()["key"])
    for limit in (None, 1, 2):
        assert walk(ta, limit=limit) == [["b"]]  # its own tenant only, at any limit
    assert get_page(ta, cursor=encode_cursor("tenants", ("a",)))["data"][0]["id"] == "b"
    assert get_page(ta, cursor=encode_cursor("tenants", ("b",)))["data"] == []
    assert len(ids(walk(ta, "/b/keys", 1))) == 1
    # another tenant's keys: 403 before the query is even read
    for params in ({"limit": 1}, {"limit": "bad"}, {"cursor": "bad"}):
        r = httpx.get(ta.base + "/a/keys", params=params, headers=ta.headers, timeout=10)
        assert error(r, 403)["code"] == "permission_denied"
    for key in (None, TEST_KEY, "sk-unknown"):
        r = httpx.get(op.base, params={"limit": 1}, timeout=10,
                      headers={} if key is None else {"authorization": f"Bearer {key}"})
        error(r, 401)


def test_pages_of_one_version_read_the_store_once(gw: ThreadedGateway,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    op = Admin(gw)
    for i in range(5):
        assert op("POST", "", {"id": f"t{i}"}).status_code == 201
    store = gw.gateway.registry.store
    reads: list[int] = []
    snapshot = store.snapshot

    async def counted() -> Any:
        reads.append(1)
        return await snapshot()

    monkeypatch.setattr(store, "snapshot", counted)
    get_page(op, limit=1)  # the index of this version may be built now (or was already)
    before = len(reads)
    assert len(ids(walk(op, limit=1))) == 6 and len(ids(walk(op, "/t0/keys", 1))) == 0
    assert len(reads) == before, "a page of an unchanged store read the whole store"
    assert op("POST", "", {"id": "t9"}).status_code == 201  # a write: the next list sees it
    assert ids(walk(op, limit=2))[-1] == "t9"


# ---- Redis: a write on one replica is in the other's next page ----------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-paging"))
    server.start()
    yield server
    server.stop()


def test_a_write_on_one_replica_is_in_the_others_next_page_at_once(
        fake: FakeBackend, redis_server: RedisServer) -> None:
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    shared = with_store(config_for(fake.url), redis_server.url)
    with replica(shared) as a, replica(shared) as b:
        op_a, op_b = Admin(a), Admin(b)
        for tid in ("p", "q", "r"):
            assert op_a("POST", "", {"id": tid}).status_code == 201
        first = get_page(op_b, limit=2)  # b indexes the store's version now
        assert [t["id"] for t in first["data"]] == ["one", "p"]
        assert op_a("DELETE", "/q").status_code == 200
        assert op_a("POST", "", {"id": "s"}).status_code == 201
        key = op_a("POST", "/s/keys").json()["id"]
        # no waiting for b's registry poll: lists read the store's version every page
        assert walk_from(op_b, first["next_cursor"], 1) == ["r", "s"]
        assert ids(walk(op_b, "/s/keys", 1)) == [key]


# ---- the CLI follows next_cursor -----------------------------------------------------------------


def test_the_cli_walks_every_page_or_prints_one(gw: ThreadedGateway,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def cli(*argv: str) -> tuple[int, Any, str]:
        code = tenants_cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, json.loads(out) if out.strip() else None, err

    assert tenants_cli.WALK_LIMIT == tenants_cli.MAX_LIMIT == MAX_LIMIT
    monkeypatch.setenv("SLUICE_URL", gw.url)
    monkeypatch.setattr(tenants_cli, "WALK_LIMIT", 2)  # so a short list takes many pages
    op = Admin(gw)
    made = [f"c{i}" for i in range(5)]
    for tid in made:
        assert op("POST", "", {"id": tid}).status_code == 201
    keys = [op("POST", "/c0/keys").json()["id"] for _ in range(3)]

    code, out, _ = cli("list")
    assert code == 0 and [t["id"] for t in out["data"]] == [*made, "one"]
    assert out["has_more"] is False and out["next_cursor"] is None
    assert (out["first_id"], out["last_id"]) == ("c0", "one")
    code, out, _ = cli("keys", "c0")
    assert code == 0 and sorted(k["id"] for k in out["data"]) == sorted(keys)

    code, page1, _ = cli("list", "--limit", "4")
    assert code == 0 and [t["id"] for t in page1["data"]] == made[:4] and page1["has_more"]
    code, page2, _ = cli("list", "--limit", "4", "--cursor", page1["next_cursor"])
    assert [t["id"] for t in page2["data"]] == [made[4], "one"] and not page2["has_more"]
    code, _, err = cli("list", "--cursor", "not-a-cursor")
    assert code == 1 and "400" in err and "cursor" in err
    with pytest.raises(SystemExit) as exited:
        cli("list", "--limit", "0")
    assert exited.value.code == 2
    code, _, err = cli("keys", "ghost")
    assert code == 1 and "404" in err


def test_the_cli_walk_stops_on_an_answer_from_before_paging() -> None:
    calls: list[dict[str, str]] = []

    def answering(answer: dict[str, Any]) -> Callable[[dict[str, str]], Any]:
        def get(params: dict[str, str]) -> Any:
            calls.append(params)
            return answer
        return get

    # no has_more (a gateway from before paging): its one page is all of it
    before = answering({"object": "list", "data": [{"id": "a"}]})
    assert tenants_cli.walk(before)["data"] == [{"id": "a"}] and len(calls) == 1
    calls.clear()
    stuck = answering({"object": "list", "data": [{"id": "a"}], "has_more": True,
                       "next_cursor": "x"})
    assert len(tenants_cli.walk(stuck)["data"]) == 2
    assert len(calls) == 2  # a cursor that does not move ends the walk
