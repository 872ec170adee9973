//! plugstack.conf arguments: `socket=PATH timeout_ms=N on_daemon_error=run|fail`.

use std::path::PathBuf;

/// What to do when the daemon cannot be asked (down, slow, or answering garbage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDaemonError {
    /// Run on Slurm's own GPU choice, with one warning line on the job's stderr.
    Run,
    /// Fail the step with the reason.
    Fail,
}

/// The plugin's configuration from plugstack.conf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    /// The daemon's socket; `%n` stands for the Slurm node name.
    pub socket: String,
    pub timeout_ms: u64,
    pub on_daemon_error: OnDaemonError,
}

/// Where the daemon listens unless `socket=` says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/multiplexd/%n.sock";

impl Default for Args {
    fn default() -> Self {
        Args {
            socket: DEFAULT_SOCKET.into(),
            timeout_ms: 2000,
            on_daemon_error: OnDaemonError::Run,
        }
    }
}

impl Args {
    /// Parses the arguments; the error names the bad argument.
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Args, String> {
        let mut out = Args::default();
        for arg in args {
            let arg = arg.as_ref();
            let (key, value) = arg
                .split_once('=')
                .ok_or_else(|| format!("argument '{arg}' is not key=value"))?;
            match key {
                "socket" if !value.is_empty() => out.socket = value.to_string(),
                "timeout_ms" => {
                    out.timeout_ms = value
                        .parse()
                        .ok()
                        .filter(|&t| (1..=60_000).contains(&t))
                        .ok_or_else(|| {
                            format!("timeout_ms={value}: must be a number of milliseconds from 1 to 60000")
                        })?
                }
                "on_daemon_error" => {
                    out.on_daemon_error = match value {
                        "run" => OnDaemonError::Run,
                        "fail" => OnDaemonError::Fail,
                        _ => return Err(format!("on_daemon_error={value}: must be run or fail")),
                    }
                }
                "socket" => return Err("socket= needs a path".into()),
                _ => {
                    return Err(format!(
                        "unknown argument '{key}' (known: socket, timeout_ms, on_daemon_error)"
                    ))
                }
            }
        }
        Ok(out)
    }

    /// The socket path for `node`.
    pub fn socket_for(&self, node: &str) -> PathBuf {
        PathBuf::from(self.socket.replace("%n", node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_guides_table_names_each_argument_with_its_default() {
        let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/admin.md")).unwrap();
        let table = guide
            .split("### plugstack.conf")
            .nth(1)
            .expect("docs/admin.md has a plugstack.conf section")
            .split("\n\n| argument |")
            .nth(1)
            .expect("with an argument table")
            .split("\n\n")
            .next()
            .unwrap();
        let mut names = Vec::new();
        for row in table.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split(" | ").collect();
            let name = cells[0].trim_start_matches("| `").split('=').next().unwrap();
            let default = cells[1].trim_matches('`');
            names.push(name.to_string());
            // Its default, given, is the default.
            let given = Args::parse(&[format!("{name}={default}")]).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(given, Args::default(), "{name}={default} is not the plugin's default");
        }
        assert_eq!(names, ["socket", "timeout_ms", "on_daemon_error"]);
        let e = Args::parse(&["no_such=1"]).unwrap_err();
        assert!(e.contains("(known: socket, timeout_ms, on_daemon_error)"), "{e}");
    }

    #[test]
    fn parses_and_expands() {
        let a = Args::parse(&["socket=/s/%n.sock", "timeout_ms=500", "on_daemon_error=fail"]).unwrap();
        assert_eq!(a.socket_for("n2"), PathBuf::from("/s/n2.sock"));
        assert_eq!(a.timeout_ms, 500);
        assert_eq!(a.on_daemon_error, OnDaemonError::Fail);
        assert_eq!(Args::parse::<&str>(&[]).unwrap(), Args::default());
    }

    #[test]
    fn errors_name_the_argument() {
        for (arg, want) in [
            ("sockets=/x", "unknown argument 'sockets'"),
            ("timeout_ms=0", "timeout_ms=0"),
            ("timeout_ms=soon", "timeout_ms=soon"),
            ("on_daemon_error=maybe", "on_daemon_error=maybe"),
            ("verbose", "'verbose' is not key=value"),
            ("socket=", "socket= needs a path"),
        ] {
            let err = Args::parse(&[arg]).unwrap_err();
            assert!(err.contains(want), "{arg}: {err}");
        }
    }
}
