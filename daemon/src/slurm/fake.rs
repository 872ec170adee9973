//! The in-memory Slurm that the unit tests and the simulator share.

use super::*;

/// Slurm in memory: the jobs and nodes a test or the simulator sets, updates applied as
/// slurmctld applies them (a claim of a job that is not pending fails with
/// [`SlurmError::NotPending`]), and every call counted.
#[derive(Debug, Default)]
pub struct Fake {
    pub state: Mutex<FakeState>,
}

/// What [`Fake`] holds.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct FakeState {
    pub jobs: Vec<Job>,
    pub nodes: Vec<NodeInfo>,
    /// Until when (seconds from the fake's start of time, [`FakeState::now`]) the gate holds.
    pub gate_until: Option<u64>,
    /// The gate is switched off (`multiplexd gate off`).
    pub gate_off: bool,
    /// The claimers' leases (reservation name, end), and how many of their license slurm.conf
    /// has (0: none, no claimer stands by for another).
    pub leases: Vec<(String, u64)>,
    pub lease_licenses: u32,
    pub now: u64,
    /// Jobs each slurmd runs.
    pub running: Vec<(String, u32)>,
    /// What `PrivateData` says of jobs; `None`: slurmctld does not say.
    pub private_jobs: Option<bool>,
    /// Reads (squeue, sinfo) and updates (claims, gate holds, releases, requeues) made.
    pub reads: u64,
    pub updates: u64,
    /// Reservations shown (the off switch asked).
    pub reservation_reads: u64,
    pub claims: Vec<Pin>,
    /// Each running job's GPU index, where its gres has no type.
    pub gpus: Vec<(u32, u32)>,
    /// How many gate licenses slurm.conf has.
    pub licenses: u32,
    /// Whether the Slurm faked merges gres updates (22.05).
    pub merges: bool,
    /// Jobs submitted `--no-requeue`, and jobs that are not batch jobs.
    pub no_requeue: Vec<u32>,
    pub not_batch: Vec<u32>,
    /// How often each job was requeued.
    pub restarts: Vec<(u32, u32)>,
    /// The next call of these kinds fails with this text.
    pub fail: Option<String>,
    /// What slurmctld spends on a job table read, in µs per job of the table: `None`, it
    /// cannot say ([`Slurm::job_reads`]), as in the simulator.
    pub read_us_per_job: Option<u64>,
    /// What it spent on them so far.
    pub read_cost: Option<ReadCost>,
    /// sdiag is refused (`PrivateData=usage`, to a user who is not an operator).
    pub job_reads_refused: bool,
    /// GPUs jobs hold whole, `(node, gres type)` ([`Slurm::held_whole`]).
    pub held_whole: Vec<(String, String)>,
}

impl Fake {
    pub fn new(state: FakeState) -> Fake {
        Fake {
            state: Mutex::new(state),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut FakeState) -> Result<T, SlurmError>) -> Result<T, SlurmError> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = s.fail.take() {
            return Err(SlurmError::Failed(e));
        }
        f(&mut s)
    }

    fn pending_job(s: &mut FakeState, id: u32) -> Result<&mut Job, SlurmError> {
        match s.jobs.iter_mut().find(|j| j.id == id) {
            Some(j) if j.pending => Ok(j),
            _ => Err(SlurmError::NotPending(id)),
        }
    }
}

impl Slurm for Fake {
    fn jobs(&self, _partition: &str) -> Result<Vec<Job>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            if let Some(us) = s.read_us_per_job {
                let c = s.read_cost.get_or_insert_with(ReadCost::default);
                c.reads += 1;
                c.total_us += us * s.jobs.len() as u64;
            }
            Ok(s.jobs.clone())
        })
    }

    fn nodes(&self, _partition: &str) -> Result<Vec<NodeInfo>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.nodes.clone())
        })
    }

    fn claim(&self, pin: &Pin) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += if pin.gres.is_some() && pin.untyped && s.merges {
                2
            } else {
                1
            };
            let job = Fake::pending_job(s, pin.job)?;
            job.licenses = pin.licenses.clone();
            if let Some(gres) = &pin.gres {
                job.gres = gres.clone();
            }
            job.node = Some(pin.node.clone());
            job.admin_comment = Some(pin.admin_comment.clone());
            s.claims.push(pin.clone());
            Ok(())
        })
    }

    fn merges_gres_updates(&self) -> Result<bool, SlurmError> {
        self.with(|s| Ok(s.merges))
    }

    fn hold_gate(&self, _gate: &Gate, lease_s: u64) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            if s.gate_off {
                // The off reservation holds one of the licenses the gate would reserve.
                return Err(SlurmError::Failed(
                    "Error creating the reservation: Invalid license specification".into(),
                ));
            }
            s.gate_until = Some(s.now + lease_s);
            Ok(())
        })
    }

    fn reservations(&self) -> Result<Vec<Reservation>, SlurmError> {
        self.with(|s| {
            s.reservation_reads += 1;
            let now = s.now;
            let mut all: Vec<Reservation> = s
                .gate_until
                .map(|end| (GATE_RESERVATION.to_string(), end))
                .into_iter()
                .chain(s.leases.iter().cloned())
                .map(|(name, end)| Reservation {
                    name,
                    end: end.to_string(),
                    active: now < end,
                })
                .collect();
            if s.gate_off {
                all.push(Reservation {
                    name: OFF_RESERVATION.into(),
                    end: "unlimited".into(),
                    active: true,
                });
            }
            Ok(all)
        })
    }

    fn take_lease(&self, name: &str, _license: &str, seconds: u64) -> Result<bool, SlurmError> {
        self.with(|s| {
            s.updates += 1;
            let now = s.now;
            // The license is held by any lease in force; where slurm.conf has none, always.
            if s.lease_licenses == 0 || s.leases.iter().any(|(_, end)| now < *end) {
                return Ok(false);
            }
            s.leases.retain(|(n, _)| n != name);
            s.leases.push((name.to_string(), now + seconds));
            Ok(true)
        })
    }

    fn renew_lease(&self, name: &str, seconds: u64) -> Result<bool, SlurmError> {
        self.with(|s| {
            s.updates += 1;
            let end = s.now + seconds;
            // As slurmctld does, a lapsed one is brought back, whoever holds the license now.
            Ok(s.leases
                .iter_mut()
                .find(|(n, _)| n == name)
                .map(|l| l.1 = end)
                .is_some())
        })
    }

    fn delete_reservation(&self, name: &str) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            s.leases.retain(|(n, _)| n != name);
            Ok(())
        })
    }

    fn switch_gate(&self, _gate: &Gate, on: bool) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            s.gate_off = !on;
            if !on {
                s.gate_until = None;
            }
            Ok(())
        })
    }

    fn release(&self, job: u32, licenses: &str, admin_comment: &str) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            let job = Fake::pending_job(s, job)?;
            job.licenses = licenses.to_string();
            job.admin_comment = Some(admin_comment.to_string());
            Ok(())
        })
    }

    fn requeue(&self, job: u32) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            if s.no_requeue.contains(&job) || s.not_batch.contains(&job) {
                return Err(SlurmError::Failed(format!(
                    "Requested operation is presently disabled for job {job}"
                )));
            }
            match s.jobs.iter_mut().find(|j| j.id == job && !j.pending) {
                Some(j) => {
                    j.pending = true;
                    j.reason = "BeginTime".into();
                }
                None => return Err(SlurmError::Failed(format!("job {job} is not running"))),
            }
            match s.restarts.iter_mut().find(|(j, _)| *j == job) {
                Some((_, n)) => *n += 1,
                None => s.restarts.push((job, 1)),
            }
            Ok(())
        })
    }

    fn job_record(&self, id: u32) -> Result<JobRecord, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            let job = s.jobs.iter().find(|j| j.id == id).ok_or(SlurmError::NotPending(id))?;
            Ok(JobRecord {
                batch: !s.not_batch.contains(&id),
                requeue: !s.no_requeue.contains(&id),
                restarts: s.restarts.iter().find(|(j, _)| *j == id).map_or(0, |(_, n)| *n),
                admin_comment: job.admin_comment.clone(),
            })
        })
    }

    fn set_admin_comment(&self, id: u32, admin_comment: &str) -> Result<(), SlurmError> {
        self.with(|s| {
            s.updates += 1;
            let job = s
                .jobs
                .iter_mut()
                .find(|j| j.id == id)
                .ok_or(SlurmError::NotPending(id))?;
            job.admin_comment = Some(admin_comment.to_string());
            Ok(())
        })
    }

    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError> {
        self.with(|s| Ok(s.running.iter().filter(|(n, _)| n == node).map(|(_, j)| *j).collect()))
    }

    fn private_jobs(&self) -> Result<bool, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            s.private_jobs
                .ok_or_else(|| SlurmError::Failed("scontrol show config names no PrivateData".into()))
        })
    }

    fn node_record(&self, node: &str) -> Result<NodeRecord, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            match s.nodes.iter().find(|n| n.name == node) {
                Some(n) => Ok(super::parse_node_record(&format!("Gres={}", n.gres))),
                None => Err(SlurmError::Failed(format!("Node {node} not found"))),
            }
        })
    }

    fn hostnames(&self, list: &str) -> Result<Vec<String>, SlurmError> {
        self.with(|_| Ok(list.split(',').map(str::to_string).collect()))
    }

    fn job_nodes(&self, id: u32) -> Result<Option<String>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            match s.jobs.iter().find(|j| j.id == id) {
                Some(j) => Ok(j.node.clone()),
                None => Err(SlurmError::NotPending(id)),
            }
        })
    }

    fn job_gpu(&self, id: u32) -> Result<Option<u32>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.gpus.iter().find(|(j, _)| *j == id).map(|(_, g)| *g))
        })
    }

    fn license_total(&self, _name: &str) -> Result<u32, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.licenses)
        })
    }

    fn job_reads(&self) -> Result<Option<ReadCost>, SlurmError> {
        self.with(|s| {
            if s.job_reads_refused {
                return Err(SlurmError::Failed("sdiag: error: Access/permission denied".into()));
            }
            Ok(s.read_us_per_job.map(|_| s.read_cost.unwrap_or_default()))
        })
    }

    fn held_whole(&self, _partition: &str) -> Result<Vec<(String, String)>, SlurmError> {
        self.with(|s| {
            s.reads += 1;
            Ok(s.held_whole.clone())
        })
    }
}
