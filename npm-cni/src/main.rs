//! The `npm-cni` binary. Without arguments it is the CNI plugin: it reads the environment and stdin,
//! runs one invocation, prints its JSON on stdout and exits with its code (logs go to stderr). With
//! arguments it is the operator command line (`install`, `uninstall`, `--version`, `--help`).

use std::io::{self, Read, Write};

fn main() {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    if !args.is_empty() {
        let code = npm_cni::cli::run(&args, &mut io::stdout(), &mut io::stderr());
        std::process::exit(code);
    }
    let getenv = |key: &str| std::env::var(key).ok();
    let read_stdin = || {
        let mut stdin = Vec::new();
        io::stdin().read_to_end(&mut stdin).map(|_| stdin)
    };
    let outcome = npm_cni::plugin::run(&getenv, read_stdin, &mut io::stderr());
    if let Some(json) = outcome.stdout {
        let mut stdout = io::stdout().lock();
        // Nothing sensible is left to do if stdout is gone; the exit code still tells.
        let _ = writeln!(stdout, "{json}").and_then(|()| stdout.flush());
    }
    std::process::exit(outcome.exit_code);
}
