"""The weather line's one tool: a fixed forecast, so the answer can be checked."""

from __future__ import annotations

from playbooks import tool

FORECAST = "sunny and 21 degrees"


@tool
def get_weather(city: str) -> dict[str, str]:
    """Today's weather forecast for a city.

    Args:
        city: The city's name, like Paris.
    """
    return {"city": city, "forecast": FORECAST}
