"""The ``unbroken`` command: ls, show, verify, export, convert, tokenise, gc, and the
commands other wings own (run, coordinator, demo, goodput, simulate), started lazily so
``unbroken ls`` never imports the launcher.

    main        `main()`: the parser, exit codes, and where each command runs (no torch)
    commands    ls, show, verify, gc: the commands that read (gc also deletes)
    writing     export, convert: the commands that write (torch)
    output      what ``ls|show|verify --json`` print
    hf_export   ``unbroken export --format hf``: weights as the folder ``from_pretrained`` loads

Entry points: main.
May import: access, data, dcp, demo, errors, format, goodput, retention, run, saving, sdc,
state, storage, tree.
"""
