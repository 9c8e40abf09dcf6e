"""``disagg-headers-handler`` (deprecated; alias ``prefill-header-handler``): P/D headers for upstream."""

from __future__ import annotations

from dataclasses import dataclass

from epp.framework import CycleState, LLMRequest, PreRequest, SchedulingResult, register
from epp.framework.registry import deprecate
from epp.framework.wire import ENCODERS_HEADER, PREFILL_HEADER


def set_disagg_headers(
    request: LLMRequest, result: SchedulingResult, prefill_profile: str, encode_profile: str
) -> None:
    """Replace the prefill/encoder headers with the endpoints chosen by those profiles, if any."""
    headers = request.headers
    headers.pop(PREFILL_HEADER, None)
    prefill = result.profile_results.get(prefill_profile)
    if prefill is not None and prefill.target_endpoints:
        headers[PREFILL_HEADER] = prefill.target_endpoints[0].hostport
    headers.pop(ENCODERS_HEADER, None)
    encode = result.profile_results.get(encode_profile)
    if encode is not None and encode.target_endpoints:
        headers[ENCODERS_HEADER] = ",".join(e.hostport for e in encode.target_endpoints)


@dataclass(slots=True, frozen=True)
class DisaggHeadersParams:
    prefill_profile: str = "prefill"
    encode_profile: str = "encode"


class DisaggHeadersHandler(PreRequest):
    type_name = "disagg-headers-handler"
    Params = DisaggHeadersParams
    params: DisaggHeadersParams

    def pre_request(self, cycle: CycleState, request: LLMRequest, result: SchedulingResult) -> None:
        set_disagg_headers(request, result, self.params.prefill_profile, self.params.encode_profile)


register(DisaggHeadersHandler, "prefill-header-handler")
for _name in (DisaggHeadersHandler.type_name, "prefill-header-handler"):
    deprecate(_name, "disagg-profile-handler", since="v0.9.0", removal="v0.11.0")
