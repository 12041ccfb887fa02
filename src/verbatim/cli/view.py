"""``verbatim view RUN_DIR``: a local, read-only web page of a run (registered by :mod:`verbatim.cli.app`)."""

from __future__ import annotations

import typer

from verbatim.cli.console import err_console


def view_command(
    run_dir: str = typer.Argument(..., help="A run directory written by 'verbatim run' or 'verbatim train'."),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="Port on 127.0.0.1 (0: any free port)."),
    open_browser: bool = typer.Option(False, "--open", help="Open the page in the default browser."),
    static: str = typer.Option(None, "--static", help="Write one self-contained HTML file here instead of serving."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --static file."),
) -> None:
    """Look at a run: summary and training curves, rollouts, tokens coloured by source, logprob, version and
    cache, groups side by side. Serves on loopback only, reads nothing but the run; Ctrl-C stops it."""
    from pathlib import Path

    from verbatim.paths import check_output_file, check_outside_run
    from verbatim.view.run_data import check_run_dir
    from verbatim.view.server import make_server, static_page

    if static:  # the rule of every output file, as export's --out: refused before the run is read
        check_outside_run(static, "--static")
        check_output_file(static, "--static", existing_ok=force)
    check_run_dir(run_dir)
    if static:
        Path(static).write_text(static_page(run_dir), encoding="utf-8")
        err_console.print(f"wrote {static}", markup=False, highlight=False)
        return
    server = make_server(run_dir, port)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    err_console.print(f"viewing {run_dir} on {url} (Ctrl-C stops it)", markup=False, highlight=False)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
