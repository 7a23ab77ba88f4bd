"""The frontend's settings: each default, flag, VMESH_* variable and help text written once here
(services/common/config_flags.py derives the command line from them)."""

from __future__ import annotations

from dataclasses import dataclass

from vmesh.services.common.config_flags import json_object_flag, setting
from vmesh.services.common.runtime.discovery import DEFAULT_REFRESH_INTERVAL_S
from vmesh.services.common.types import Pooling, PoolingType

# Prompts are refused above this many bytes of text before they are tokenized: tokenizing is
# the one step whose cost a client controls, and it runs on a shared thread pool.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
# One HTTP request's budgets across all its prompts (and, for tokens, its n copies): what a
# request may cost is bounded before it is paid, whatever it packs into one body.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_REQUEST_TOKENS = 1 << 17
# An HTTP connection that has not sent a request's head this long after it opened (or after its
# previous response) is closed: a client trickling its headers holds a connection for free.
DEFAULT_HTTP_HEADER_TIMEOUT_S = 10.0
# ... and a request whose body has not all arrived this long after its head: a client trickling
# its body holds a connection (and a request in progress) for free. 60 s carries the largest body
# accepted (4 MiB + 64 KiB by default) at ~70 KB/s.
DEFAULT_HTTP_BODY_TIMEOUT_S = 60.0
# Connections one peer address may hold; more are closed as they open (one client cannot take
# every connection). Behind a proxy, every client shares its address: raise it, or 0 for no cap.
DEFAULT_HTTP_CONNECTIONS_PER_PEER = 1024
# How long a request may wait for a scheduler group and a detokenizer replica to take it (a lost
# one restarting, say) before it fails with UNAVAILABLE.
DEFAULT_FAILOVER_TIMEOUT_S = 60.0
# How a request picks among scheduler groups (data parallelism). prefix-table: prefix routing on
# this frontend's own record only, never the groups' cache streams (what every frontend did
# before the streams; a baseline for benchmarks, or for schedulers that must not be watched).
ROUTING_POLICIES = ("prefix", "prefix-table", "least-busy")
DEFAULT_ROUTING = "prefix"

# --tool-call-parser: vLLM's names of the tool-call formats vmesh parses (services/frontend/tool_parsers/
# registry.py holds one format per name), or auto, the served model's own (chosen from its chat template,
# vocabulary and family as the frontend starts).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")

# vLLM's embed default for decoder models: the last token's hidden state, scaled to unit norm.
DEFAULT_POOLING = Pooling(PoolingType.LAST, normalize=True)
_POOLER_KEYS = ("pooling_type", "normalize")


def parse_pooler_config(text: str) -> Pooling:
    """vLLM's --pooler-config JSON, '{"pooling_type": "MEAN", "normalize": false}' -> Pooling (a
    key left out keeps DEFAULT_POOLING's value). Unknown keys and values are refused with ValueError."""
    raw = json_object_flag("--pooler-config", text, _POOLER_KEYS)
    names = [t.value for t in PoolingType]
    pooling_type = raw.get("pooling_type", DEFAULT_POOLING.type.value)
    if pooling_type not in names:
        raise ValueError(f"--pooler-config: pooling_type {pooling_type!r} is not one of {', '.join(names)}")
    normalize = raw.get("normalize", DEFAULT_POOLING.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"--pooler-config: normalize must be true or false, got {normalize!r}")
    return Pooling(PoolingType(pooling_type), normalize)


def checked_pooler_config(text: str) -> str:
    """The flag's argparse type: the text as given (forwarded as it is), refused here if it does not parse."""
    parse_pooler_config(text)
    return text


HTTP_PORT_HELP = "serve the OpenAI-compatible HTTP API on --host at this port (0: any free port)"


@dataclass
class FrontendSettings:
    http_port: int | None = setting(  # None: no HTTP API (`vmesh serve` turns it on by default)
        None, section="frontend", parse_flag=int, help=HTTP_PORT_HELP + "; default: off")
    serve_http: bool = setting(True, section="frontend", flag="--no-http", negated=True,
                               help="do not serve the HTTP API")
    api_key: str | None = setting(
        None, section="frontend",
        help="require 'Authorization: Bearer KEY' on every HTTP path but /health, /metrics and /openapi.json, "
             "and 'authorization: Bearer KEY' gRPC metadata on Generate/Tokenize/GetModelInfo (health checks "
             "stay open)")
    max_prompt_bytes: int = setting(
        DEFAULT_MAX_PROMPT_BYTES, section="frontend",
        help="prompts with more bytes of text are refused (INVALID_ARGUMENT / HTTP 400) before tokenizing")
    max_request_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BYTES, section="frontend",
        help="an HTTP request whose prompts together hold more bytes of text is refused (400) before tokenizing; "
             "the body limit (413) is this plus 64 KiB")
    max_request_tokens: int = setting(
        DEFAULT_MAX_REQUEST_TOKENS, section="frontend",
        help="an HTTP request whose prompts' tokens times n exceed this is refused (400): token ids before any "
             "copy, text as it is tokenized")
    http_header_timeout_s: float = setting(
        DEFAULT_HTTP_HEADER_TIMEOUT_S, section="frontend", flag="--http-header-timeout",
        help="seconds an HTTP connection may take to send a request's line and headers (after opening, or after "
             "its previous response) before it is closed")
    http_body_timeout_s: float = setting(
        DEFAULT_HTTP_BODY_TIMEOUT_S, section="frontend", flag="--http-body-timeout",
        help="seconds an HTTP request's body may take to arrive in full, from its headers, before the connection "
             "is closed")
    http_connections_per_peer: int = setting(
        DEFAULT_HTTP_CONNECTIONS_PER_PEER, section="frontend",
        help="HTTP connections one client address may hold open (more are closed at once); 0: no cap")
    public_tls_cert: str | None = setting(
        None, section="frontend",
        help="serve the public gRPC port and the HTTP API over TLS with this certificate (and --public-tls-key)")
    public_tls_key: str | None = setting(None, section="frontend")
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load endpoint reads a directory the client names.
    allow_runtime_lora_updating: bool = setting(
        False, section="frontend", help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (LoRA "
                                        "adapters onto every scheduler group and worker rank at run time)")
    routing: str = setting(
        DEFAULT_ROUTING, section="frontend", choices=ROUTING_POLICIES,
        help="how a request picks among scheduler groups (data parallelism): prefix = the group most likely to "
             "hold its prompt's prefix in cache (load breaks ties; an overloaded group is passed over); "
             "prefix-table = the same from this frontend's own record of what it sent where, without the "
             "groups' cache streams; least-busy = the fewest of this frontend's requests in flight")
    # The server's pooling for POST /v1/embeddings; None: DEFAULT_POOLING (the `pooling` property).
    pooler_config: Pooling | None = setting(
        None, section="frontend", parse_flag=checked_pooler_config, to_field=parse_pooler_config,
        help='how POST /v1/embeddings pools the prompt\'s final hidden states, vLLM\'s JSON: \'{"pooling_type": '
             '"LAST", "normalize": true}\' (pooling_type LAST, MEAN or CLS; a request\'s "normalize" overrides); '
             'default: LAST, normalized')
    tool_call_parser: str = setting(
        "auto", section="frontend", choices=TOOL_CALL_PARSERS,
        help="how chat completions with tools (tool_choice auto) read the model's calls, vLLM's names: hermes "
             "(<tool_call> JSON: Qwen2.5, Qwen3), llama3_json (JSON with \"parameters\", after <|python_tag|> or "
             "alone: Llama 3.x), mistral ([TOOL_CALLS] then JSON), pythonic ([f(x=1)]: Gemma 3, Llama 3.2); "
             "auto: the format the model's chat template writes, else the one whose special token its vocabulary "
             "has, else pythonic for Gemma, else hermes. A template that does not render tools gets vmesh's "
             "built-in prompt asking for the chosen format")
    failover_timeout_s: float = setting(
        DEFAULT_FAILOVER_TIMEOUT_S, section="frontend", flag="--failover-timeout",
        help="seconds a request whose scheduler or detokenizer replica was lost may wait for another (or the "
             "restarted one) to take it, with the tokens it has; past it: UNAVAILABLE")

    @property
    def http_api_port(self) -> int | None:
        """Where the HTTP API listens; None: nowhere."""
        return self.http_port if self.serve_http else None

    @property
    def pooling(self) -> Pooling:
        """How an embedding request is pooled unless it says otherwise."""
        return self.pooler_config or DEFAULT_POOLING


@dataclass(kw_only=True)
class FrontendServiceSettings(FrontendSettings):
    """One frontend process's settings: the frontend's own and where its peers are (the peers'
    flags are the frontend subcommand's own; `vmesh serve` sets them instead of forwarding them)."""
    scheduler_addresses: list[str]  # host:port or dns:///name:port specs, re-resolved periodically; one per group
    detokenizer_addresses: list[str]  # the same, for the detokenizer replicas
    replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S
    model_name: str | None = None  # the model whose tokenizer it loads (None: not checked against the schedulers')
