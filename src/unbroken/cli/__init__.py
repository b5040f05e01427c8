"""The ``unbroken`` command: ls, show, verify, export, convert, tokenise, gc, and the
commands other wings own (run, coordinator, demo, goodput, simulate), started lazily so
``unbroken ls`` never imports the launcher.

    main        `main()`: the parser and the checkpoint commands
    output      what ``ls|show|verify --json`` print
    hf_export   ``unbroken export --format hf``: weights as the folder ``from_pretrained`` loads

Entry points: main.
May import: access, data, dcp, demo, errors, format, goodput, retention, run, saving, sdc,
state, storage.
"""
