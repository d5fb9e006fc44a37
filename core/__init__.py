"""The plumbing every hdr package uses: user errors, typed config loading, registries,
progress output, output-path safety and the options the subcommands share. It imports none of
hdr's packages, so any of them can use it."""
