"""``dovetail serve [MODEL]``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os

from dovetail.cli.engine_args import add_engine_arguments, engine_kwargs
from dovetail.server.tool_parsers import tool_parser_names


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_engine_arguments(p, model_positional=True)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use for the model (default: the MODEL argument); the first is reported")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (env DOVETAIL_API_KEY)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 to a request whose sequences would make more than this many wait to be "
                        "scheduled (default: no limit)")
    s.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="answer 400 to a request of more sequences (n times the number of prompts; default 256)")
    s.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="answer only requests whose Host header names one of these ('*.example.com' for "
                        "subdomains, '*' for any); default: localhost, 127.0.0.1 and [::1] when listening on "
                        "a loopback address without --api-key, else any")
    s.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="answer 413 to larger request bodies (default 32 MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before aborting them (default 30)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser')
    s.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json, mistral, "
                        "qwen3_coder")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report the prompt tokens the prefix cache held (usage.prompt_tokens_details.cached_tokens)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template for /v1/chat/completions, in place of the tokenizer's: a file, or "
                        "the template itself")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served as models of their own (needs --enable-lora): NAME=PATH, or JSON "
                        '\'{"name": NAME, "path": PATH}\'')
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log each HTTP request")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dovetail.errors import ConfigError

    for flag, low in (("port", 0), ("max_waiting_requests", 1), ("max_sequences_per_request", 1),
                      ("max_body_bytes", 1), ("shutdown_timeout", 0)):
        value = getattr(args, flag)
        if value is not None and not value >= low:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be at least {low} (got {value})")
    if args.port > 65535:
        raise ConfigError(f"--port: must be at most 65535 (got {args.port})")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice: needs --tool-call-parser (one of "
                          f"{', '.join(tool_parser_names())})")

    from dovetail.chat_template import load_chat_template
    from dovetail.llm import default_model
    from dovetail.server.launcher import serve
    from dovetail.server.state import ServerSettings

    chat_template = load_chat_template(args.chat_template)  # a broken template stops here, before the model loads

    model = args.model or default_model()
    names = args.served_model_name or [args.model or "bundled-model"]
    lora_modules = parse_lora_modules(args.lora_modules, bool(args.enable_lora), names)  # before the model loads
    kwargs = engine_kwargs(args)
    if args.max_waiting_requests is not None:
        kwargs["max_waiting_requests"] = args.max_waiting_requests
    kwargs.setdefault("served_model_name", names[0])
    api_key = args.api_key or os.environ.get("DOVETAIL_API_KEY")
    settings = ServerSettings(served_model_names=names, api_key=api_key, max_body_bytes=args.max_body_bytes,
                              max_sequences_per_request=args.max_sequences_per_request,
                              allowed_hosts=allowed_hosts(args.allowed_hosts, args.host, api_key),
                              tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                              chat_template=chat_template, lora_modules=lora_modules,
                              enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    return serve(model, kwargs, settings, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout,
                 uvicorn_log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log)


def parse_lora_modules(items: list[str] | None, enabled: bool, served_names: list[str]) -> dict:
    """``--lora-modules`` as served name -> :class:`~dovetail.lora.LoRARequest` (ids from 1 in order), each
    adapter's configuration checked; one line naming the flag for what is wrong."""
    from dovetail.errors import ConfigError, RequestError
    from dovetail.lora.adapter import read_config
    from dovetail.lora.request import LoRARequest

    if not items:
        return {}
    if not enabled:
        raise ConfigError("--lora-modules: needs --enable-lora")
    modules = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                value = json.loads(item)
                name, path = value["name"], value["path"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"--lora-modules: {item!r} is not a JSON object with 'name' and 'path'") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules: {item!r} is not NAME=PATH")
        if name in modules or name in served_names:
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice (adapters and the model are "
                              "served under distinct names)")
        try:
            read_config(path)
            modules[name] = LoRARequest(name, len(modules) + 1, path)
        except RequestError as exc:
            raise ConfigError(f"--lora-modules: {name}: {str(exc).removeprefix('lora_request: ')}") from None
    return modules


#: The names a browser on this machine uses for a server listening on loopback.
LOOPBACK_NAMES = ["localhost", "127.0.0.1", "[::1]"]


def allowed_hosts(given: list[str] | None, host: str, api_key: str | None) -> list[str] | None:
    """The Host header allow-list (None: any host): ``--allowed-hosts``, else the loopback names for a
    loopback server without an API key (a web page cannot send the key, but can reach loopback)."""
    if given is not None:
        return None if "*" in given else given
    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host.lower() == "localhost"
    return list(LOOPBACK_NAMES) if loopback else None
