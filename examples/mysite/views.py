"""Views with costs: a report that is worth four ordinary requests, an item collection whose
writes cost two seats, and a probe."""

import json
import time

from django.http import HttpResponse, JsonResponse
from django.views import View

from apf_gunicorn.django import cost


def _work(request) -> int:
    """Hold the thread ``?ms=`` milliseconds (at most 60 s), to see queuing."""
    try:
        ms = min(max(int(request.GET.get("ms", "50")), 0), 60_000)
    except ValueError:
        ms = 50
    time.sleep(ms / 1000)
    return ms


@cost(seats=4)
def report(request, year: int):
    """An expensive report: admitted with 4 seats."""
    return JsonResponse({"year": year, "worked_ms": _work(request)})


class Items(View):
    """A collection: reads cost the default one seat, writes two."""

    def get(self, request):
        return JsonResponse({"items": [], "worked_ms": _work(request)})

    @cost(seats=2)
    def post(self, request):
        body = json.loads(request.body or b"{}")
        return JsonResponse({"created": body}, status=201)


def healthz(request):
    return HttpResponse("ok\n", content_type="text/plain")
