"""A stand-in for kvpush's connector, scheduler side only, for
``test_decode_first_token.py``: every request's prompt arrives from
outside, asynchronously, and the test says which first tokens came."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from kvpush.transfer.messages import FirstToken, SampleLogprobs


class FirstTokenConnector(KVConnectorBase_V1):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # req id -> prefill's first token (a bare id: without logprobs)
        self.tokens: dict[str, int | FirstToken] = {}
        self.kept: dict[str, SampleLogprobs] = {}  # keep_first_logprobs's
        self.outcomes: list[Any] = []  # first_token_outcome's reasons
        self.claimed: set[str] = set()
        self.expected: set[str] = set()  # req ids whose t1 prefill will tell
        self.prefilled: set[str] = set()  # req ids whose first logprobs it keeps

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.request_id in self.claimed:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            self.claimed.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return False, None

    def first_token(self, request: Any) -> FirstToken | None:
        first = self.tokens.pop(request.request_id, None)
        if isinstance(first, int):
            return FirstToken("t-" + request.request_id, "prefill0", first)
        return first

    def wants_first_logprobs(self, request: Any) -> bool:
        return request.request_id in self.prefilled

    def keep_first_logprobs(self, request: Any, logprobs: SampleLogprobs) -> None:
        self.kept[request.request_id] = logprobs

    def awaits_first_token(self, request: Any) -> bool:
        rid = request.request_id
        return rid in self.expected and rid not in self.tokens

    def first_token_outcome(self, reason: Any) -> None:
        self.outcomes.append(reason)

    # the worker side is never used here
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...
