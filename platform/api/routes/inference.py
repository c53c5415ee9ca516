"""OpenAI-compatible inference routes: /v1/completions, /v1/chat/completions, /v1/models.

The answers are built in platform/openai/ (completions.py, chat.py) as the typed models of
platform/openai/responses.py; a streamed answer is server-sent events of the chunk models.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplex.platform.api.deps import CallerDep, StateDep
from loraplex.platform.api.errors import API_ERRORS
from loraplex.platform.db import crud
from loraplex.platform.db.models import AdapterStatus
from loraplex.platform.guardrails import routes as guardrail_routes
from loraplex.platform.openai.chat import serve_chat
from loraplex.platform.openai.completions import serve_completion
from loraplex.platform.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.platform.openai.responses import (
    ChatCompletion,
    Completion,
    ModelCard,
    ModelList,
    ModelPermission,
)

router = APIRouter(prefix="/v1", tags=["inference"], responses=API_ERRORS)
# JSON, or server-sent events with "stream": true.
_STREAMABLE = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}
# A typed answer is written by JSONResponse (json.dumps) rather than FastAPI's pydantic fast
# path, whose float spelling differs ("1e-7" for Python's "1e-07"): the same bytes as always.
_TYPED = {"response_class": JSONResponse}


@router.get("/models", response_model=ModelList, **_TYPED)
def list_models(state: StateDep, caller: CallerDep):
    """The base model and the caller's ready adapters as vLLM's model cards: the base has
    `root` = its name (never its folder: a server path) and `parent` null; an adapter has
    `parent` = the base and `root` = "sha256:<digest>", the content it was stored as. Our
    extension `architecture` says what every card runs on (see `architecture`)."""
    created = int(time.time())
    base = state.model_name
    limit = state.engine.config.max_model_len if state.engine is not None else None
    arch = architecture(state.spec)
    common = {"object": "model", "max_model_len": limit, "architecture": arch}
    data = [ModelCard(id=base, created=created, owned_by="loraplex", root=base, parent=None,
                      permission=[_permission(created)], **common)]  # fmt: skip
    with state.sessions() as session:
        # One card per name (its versions are in /v1/adapters; `name@vN` serves any of them),
        # dated by its first version, rooted in its newest.
        names: dict[str, list] = {}
        for a in crud.list_adapters(session, tenant_id=caller.tenant.id):
            if a.status == AdapterStatus.ready:
                names.setdefault(a.name, []).append(a)
        for name, versions in names.items():
            at = int(versions[0].created_at.timestamp())
            data.append(ModelCard(id=name, created=at, owned_by=caller.tenant.name,
                                  root=f"sha256:{versions[-1].sha256}", parent=base,
                                  permission=[_permission(at)], **common))  # fmt: skip
    return ModelList(object="list", data=data)


def architecture(spec) -> dict | None:
    """The base model's family (its config's `model_type`, e.g. "qwen3_moe") and, for a
    mixture of experts, how many experts it routes among and how many each token takes
    (null for a dense model): what an adapter must have been trained on. Null while the
    model loads."""
    if spec is None:
        return None
    moe = None
    if spec.num_experts:
        moe = {"num_experts": spec.num_experts, "experts_per_token": spec.top_k}
    return {"family": spec.family, "mixture_of_experts": moe}


def _permission(created: int) -> ModelPermission:
    """What a tenant's key may do with the model: sample and read logprobs; no fine-tuning
    through this API."""
    return ModelPermission(
        id=f"modelperm-{uuid.uuid4().hex}", object="model_permission", created=created,
        allow_create_engine=False, allow_sampling=True, allow_logprobs=True,
        allow_search_indices=False, allow_view=True, allow_fine_tuning=False,
        organization="*", group=None, is_blocking=False,
    )  # fmt: skip


@router.post("/completions", response_model=Completion, responses=_STREAMABLE, **_TYPED)
async def create_completion(
    body: CompletionRequest, request: Request, state: StateDep, caller: CallerDep
):
    return await serve_completion(body, request, state, caller)


@router.post("/chat/completions", response_model=ChatCompletion, responses=_STREAMABLE, **_TYPED)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: StateDep, caller: CallerDep
):
    return await serve_chat(body, request, state, caller)


# The Batch API runner (platform/batch_runner.py) answers each line through these: the
# routes' own answers, as the JSON values its output file holds.
async def completions(body: CompletionRequest, request, state, caller) -> dict:
    return (await serve_completion(body, request, state, caller)).model_dump()


async def chat_completions(body: ChatCompletionRequest, request, state, caller) -> dict:
    return (await serve_chat(body, request, state, caller)).model_dump()


router.include_router(guardrail_routes.tenant_router)  # /v1/guardrails: read-only
