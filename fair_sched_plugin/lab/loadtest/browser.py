"""A headless Chromium for `/fair-sched/ui`: screenshots for the bench report, and the UI test.

Debian's ``chromium`` package driven by playwright's Python client, which ships its own driver
and needs no browser download (``playwright install`` is never run: we point it at the system
binary). Both are optional: `screenshot_while` says plainly what is missing instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...observability import UI_PATH

if TYPE_CHECKING:
    from playwright.async_api import Page

# What works in a container without a GPU, a sandbox or a network.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
VIEWPORT = {"width": 1280, "height": 900}
DASHBOARD_TIMEOUT_MS = 20_000


def find_chromium() -> str | None:
    """The system Chromium (``FAIR_SCHED_CHROMIUM`` overrides), or None."""
    configured = os.environ.get("FAIR_SCHED_CHROMIUM")
    if configured:
        return configured if Path(configured).exists() else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def missing_browser_parts() -> str | None:
    """None when a screenshot can be taken, else what is missing, in words."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install '.[dev]')"
    if find_chromium() is None:
        return "no Chromium binary (apt-get install chromium)"
    return None


@contextlib.asynccontextmanager
async def chromium_page(profile_dir: Path) -> AsyncIterator[Page]:
    """A fresh headless Chromium (its own profile in `profile_dir`) and one page in it."""
    from playwright.async_api import async_playwright

    executable = find_chromium()
    if executable is None:
        raise RuntimeError("no Chromium binary (apt-get install chromium)")
    async with async_playwright() as driver:
        context = await driver.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=executable,
            headless=True,
            args=list(CHROMIUM_FLAGS),
            viewport=VIEWPORT,  # type: ignore[arg-type]
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            yield page
        finally:
            await context.close()


async def log_in(page: Page, base_url: str, admin_key: str) -> None:
    """Open the page, type the key into the prompt and wait for the dashboard."""
    await page.goto(f"{base_url.rstrip('/')}{UI_PATH}")
    await page.locator("#key").fill(admin_key)
    await page.locator("#login button[type=submit]").click()
    await page.locator("#dashboard .model").first.wait_for(timeout=DASHBOARD_TIMEOUT_MS)


async def screenshot_while(
    base_url: str,
    admin_key: str,
    path: Path,
    load: Callable[[], Awaitable[object]],
    *,
    after_s: float,
) -> str:
    """Log in to `base_url`'s page, start `load()`, save a PNG at `path` `after_s` later, and
    wait for the load to end.

    Returns a sentence for the report: what was captured, or why nothing was (a missing
    browser or a browser failure is a note in the report, never a failed benchmark).
    """
    missing = missing_browser_parts()
    if missing is not None:
        return f"No screenshot of {UI_PATH}: {missing}."
    try:
        with tempfile.TemporaryDirectory(prefix="fair-sched-chromium-") as profile:
            async with chromium_page(Path(profile)) as page:
                await log_in(page, base_url, admin_key)
                running = asyncio.ensure_future(load())
                try:
                    await asyncio.sleep(after_s)
                    await page.screenshot(path=str(path), full_page=True)
                finally:
                    await running
    except Exception as exc:
        return f"No screenshot of {UI_PATH}: Chromium failed ({type(exc).__name__}: {exc})."
    return f"{UI_PATH} during the flood, taken with headless Chromium ({Path(path).name})."
