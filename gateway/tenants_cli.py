"""`sluice tenants …`: the admin API from the command line (httpx); prints JSON.

    sluice tenants list [--limit N] [--cursor C] | keys ID [--limit N] [--cursor C]
    sluice tenants get ID | delete ID | usage ID
    sluice tenants create ID [--name N] [--models a,b] [--tpm N] [--rpm N] [--tpd N]
                             [--tpm-month N] [--max-concurrency N] [--max-queued N]
                             [--priority-default N --priority-min N --priority-max N]
                             [--fail-mode open|closed] [--weight W] [caps flags]
    sluice tenants update ID [the same flags; a limit of 'unlimited' clears it]
    sluice tenants add-key ID [--role user|tenant_admin]
    sluice tenants delete-key ID KEY_ID

``--url`` (env SLUICE_URL, default http://127.0.0.1:8000) and ``--admin-key`` (env
SLUICE_ADMIN_KEY) go before or after the action. Exit status 0 on success; 1 with the
API's error message on stderr when the gateway refuses; 2 for a usage error. ``list`` and
``keys`` follow ``next_cursor`` through every page and print one list, unless ``--limit`` or
``--cursor`` asks for one page, printed as the API answers it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
UNLIMITED = "unlimited"
MAX_LIMIT = 1000  # the most a page of the admin API holds (gateway/paging.py)
WALK_LIMIT = MAX_LIMIT  # the page size when following every page
_CLEAR = object()  # a limit to remove (PATCH null)

# flag -> (section, field)
_QUOTA_FLAGS = {
    "tpm": ("quotas", "tokens_per_minute"),
    "rpm": ("quotas", "requests_per_minute"),
    "tpd": ("quotas", "tokens_per_day"),
    "tpm_month": ("quotas", "tokens_per_month"),
    "max_concurrency": ("quotas", "max_concurrency"),
    "max_queued": ("quotas", "max_queued"),
    "max_body_bytes": ("caps", "max_body_bytes"),
    "max_prompt_tokens": ("caps", "max_prompt_tokens"),
    "max_tokens": ("caps", "max_tokens"),
}
_PRIORITY_FLAGS = {"priority_default": "default", "priority_min": "min", "priority_max": "max"}


def _limit(least: int) -> Callable[[str], Any]:
    """An argparse type: a whole number >= ``least`` (quotas 0, caps 1, as the admin API
    validates them), or 'unlimited' (or 'none'), which clears the limit. argparse puts the
    flag in front of the message: ``argument --tpm: expected …``."""
    def parse(text: str) -> Any:
        if text.strip().lower() in (UNLIMITED, "none"):
            return _CLEAR
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {least} or {UNLIMITED!r}, got {text!r}")
        return value
    return parse


def _policy_flags(p: argparse.ArgumentParser) -> None:
    quota, cap = _limit(0), _limit(1)
    p.add_argument("--name")
    p.add_argument("--models", help="comma-separated model names, or '*' for all")
    p.add_argument("--tpm", type=quota, help="tokens per minute")
    p.add_argument("--rpm", type=quota, help="requests per minute")
    p.add_argument("--tpd", type=quota, help="tokens per day")
    p.add_argument("--tpm-month", type=quota, help="tokens per month")
    p.add_argument("--max-concurrency", type=quota)
    p.add_argument("--max-queued", type=quota)
    p.add_argument("--max-body-bytes", type=cap, help="cap: request body bytes")
    p.add_argument("--max-prompt-tokens", type=cap, help="cap: prompt tokens")
    p.add_argument("--max-tokens", type=cap, help="cap: max_tokens")
    p.add_argument("--on-exceed", choices=["reject", "clamp"], help="over the max_tokens cap")
    p.add_argument("--priority-default", type=int)
    p.add_argument("--priority-min", type=int)
    p.add_argument("--priority-max", type=int)
    p.add_argument("--fail-mode", choices=["open", "closed"])
    p.add_argument("--weight", type=float, help="fair share within a priority class")


def policy_body(args: argparse.Namespace) -> dict[str, Any]:
    """The tenant fields the flags set; a cleared limit is null (PATCH: back to unlimited)."""
    body: dict[str, Any] = {}
    if args.name is not None:
        body["name"] = args.name
    if args.models is not None:
        body["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    for flag, (section, field) in _QUOTA_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            body.setdefault(section, {})[field] = None if value is _CLEAR else value
    if args.on_exceed is not None:
        body.setdefault("caps", {})["on_exceed"] = args.on_exceed
    for flag, field in _PRIORITY_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            body.setdefault("priority", {})[field] = value
    if args.fail_mode is not None:
        body["fail_mode"] = args.fail_mode
    if args.weight is not None:
        body["weight"] = args.weight
    return body


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body) of the action."""
    t = "/admin/v1/tenants"
    action = args.action
    if action == "list":
        return "GET", t, None
    if action == "create":
        return "POST", t, {"id": args.id, **policy_body(args)}
    if action == "update":
        return "PATCH", f"{t}/{args.id}", policy_body(args)
    if action == "get":
        return "GET", f"{t}/{args.id}", None
    if action == "delete":
        return "DELETE", f"{t}/{args.id}", None
    if action == "keys":
        return "GET", f"{t}/{args.id}/keys", None
    if action == "add-key":
        return "POST", f"{t}/{args.id}/keys", {"role": args.role}
    if action == "delete-key":
        return "DELETE", f"{t}/{args.id}/keys/{args.key_id}", None
    return "GET", f"{t}/{args.id}/usage", None


class _Refused(Exception):
    """The gateway answered an error (or could not be reached)."""


def _answer(resp: Any) -> Any:
    """The JSON of an httpx response; _Refused with the API's message for an error."""
    try:
        out = resp.json()
    except ValueError:
        out = {"error": {"message": resp.text.strip() or resp.reason_phrase}}
    if resp.status_code >= 400:
        err = out.get("error") if isinstance(out, dict) else None
        message = err.get("message") if isinstance(err, dict) else resp.text
        raise _Refused(f"{resp.status_code}: {message}")
    return out


def walk(get_page: Callable[[dict[str, str]], Any]) -> Any:
    """Every item of a paged list, following ``next_cursor`` from the first page to the last,
    as one list in the API's shape (``has_more`` false). An answer that is not a paged list
    (a gateway from before paging) is returned as it is."""
    params = {"limit": str(WALK_LIMIT)}
    data: list[Any] = []
    while True:
        out = get_page(params)
        if not isinstance(out, dict) or not isinstance(out.get("data"), list):
            return out
        data.extend(out["data"])
        cursor = out.get("next_cursor")
        if out.get("has_more") is not True or not isinstance(cursor, str) \
                or cursor == params.get("cursor"):  # a cursor that does not move: stop
            break
        params = {"limit": str(WALK_LIMIT), "cursor": cursor}

    def item_id(i: int) -> Any:
        return data[i].get("id") if data and isinstance(data[i], dict) else None
    return {"object": "list", "data": data, "has_more": False, "first_id": item_id(0),
            "last_id": item_id(-1), "next_cursor": None}


def run(args: argparse.Namespace) -> int:
    import httpx

    url = (args.url or os.environ.get("SLUICE_URL") or DEFAULT_URL).rstrip("/")
    key = args.admin_key or os.environ.get("SLUICE_ADMIN_KEY")
    if not key:
        print("sluice tenants: give --admin-key or set SLUICE_ADMIN_KEY", file=sys.stderr)
        return 2
    method, path, body = _request(args)
    one_page = {name: str(value) for name in ("limit", "cursor")
                if (value := getattr(args, name, None)) is not None}
    try:
        with httpx.Client(timeout=args.timeout,
                          headers={"authorization": f"Bearer {key}"}) as client:
            def get_page(params: dict[str, str]) -> Any:
                return _answer(client.get(url + path, params=params))

            if args.action not in ("list", "keys"):
                out = _answer(client.request(method, url + path, json=body))
            elif one_page:
                out = get_page(one_page)
            else:
                out = walk(get_page)
    except httpx.HTTPError as exc:
        print(f"sluice tenants: cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    except _Refused as exc:
        print(f"sluice tenants: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


def _page_size(text: str) -> int:
    """An argparse type: a page size the admin API takes, 1 to MAX_LIMIT."""
    if text.isascii() and text.isdigit() and len(text) <= 4 and 1 <= int(text) <= MAX_LIMIT:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {MAX_LIMIT}, "
                                     f"got {text!r}")


def _page_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=_page_size, help="print one page of this many (1 to 1000) "
                   "instead of every page")
    p.add_argument("--cursor", help="print the page after this next_cursor")


def _connection_flags(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("--url", default=default,
                   help=f"the gateway (env SLUICE_URL; default {DEFAULT_URL})")
    p.add_argument("--admin-key", default=default,
                   help="operator or tenant-admin key (env SLUICE_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=default if default is not None else 10.0,
                   help="seconds (default 10)")


def register(sub: Any) -> None:
    """Add `sluice tenants` to the `sluice` parser."""
    t = sub.add_parser("tenants", help="manage tenants and their keys over the admin API")
    _connection_flags(t, None)
    actions = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    # after the action too; SUPPRESS: absent there, the value given before it stays
    leaf = argparse.ArgumentParser(add_help=False)
    _connection_flags(leaf, argparse.SUPPRESS)

    def action(name: str, help_: str, *ids: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = actions.add_parser(name, help=help_, parents=[leaf])
        for ident in ids:
            p.add_argument(ident)
        return p

    _page_flags(action("list", "list tenants (every page, unless --limit or --cursor)"))
    action("get", "show a tenant", "id")
    _policy_flags(action("create", "create a tenant (omitted limits: unlimited)", "id"))
    _policy_flags(action("update", "change a tenant (only the fields given)", "id"))
    action("delete", "delete a tenant and its keys", "id")
    _page_flags(action("keys", "list a tenant's keys (ids and roles, never the keys)", "id"))
    add_key = action("add-key", "make a key; it is printed once, never stored", "id")
    add_key.add_argument("--role", choices=["user", "tenant_admin"], default="user")
    action("delete-key", "delete a key", "id", "key_id")
    action("usage", "a tenant's usage: reserved and settled tokens, requests, rejects", "id")
    t.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    """`sluice tenants` on its own: ``main(["list", "--url", …])``."""
    parser = argparse.ArgumentParser(prog="sluice")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tenants", *(sys.argv[1:] if argv is None else argv)])
    return run(args)
