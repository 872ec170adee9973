//! The cluster's claimer: multiplexed jobs wait out of Slurm's own placement, each holding a
//! license of the gate (`Reason=Licenses`), until the claimer pins one to the GPU it chose, in
//! Slurm's terms: one `scontrol update` drops the gate's license and sets the job's gres to
//! that GPU's type (`shard:v100_1:1`) and its node list to that node. Slurm then allocates,
//! fences and accounts exactly that GPU. Nothing is moved or declined after a job starts.
//!
//! Every daemon with `[claim] enabled` runs it on a thread of its own; the one holding the
//! claimers' lease claims, the others stand by ([`Election`]). Every `look_ms` the holder asks
//! whether the gate is switched off ([`gate`]), renews the gate's lease when due, reads the
//! shared partition's jobs where their cost to slurmctld allows ([`pace`]; one squeue: what
//! runs on which GPU and what waits, in Slurm's order), applies what changed to the board it
//! keeps between looks ([`Board`]), and claims through [`crate::claim::choose_on`] over its
//! history, which holds what every node learned where the nodes pool their histories
//! (`[share] dir`). Its nodes come from sinfo once a minute.
//!
//! Fail-open: the gate is a reservation of every license of its name, renewed `lease_s` ahead.
//! With the claimer gone (its daemon stopped or killed, its host down) a standby takes over
//! within about 20 s; with none, the gate lapses within `lease_s`, and every waiting job
//! starts where Slurm's own placement puts it; the node's daemon records it there.

use crate::claim::{Board, Candidate, Choice, Memory, NodeGpus};
use crate::slurm::{Job, NodeInfo, Pin, Slurm, SlurmError};
use multiplex_protocol::gres::{gpu_type, split_gpu_type};
use multiplex_protocol::spec::{with_note, Spec};
use multiplex_protocol::Claim;
use std::collections::HashMap;
use std::time::Duration;

pub use crate::config::ClaimConfig;
pub use scorer::Scorer;
pub use thread::spawn;

mod election;
mod gate;
mod nodes;
mod pace;
mod read;
mod scorer;
mod thread;

pub use election::{Election, LEASE_LICENSE, LEASE_PREFIX, TAKEOVER_S};
pub use gate::{gate, LICENSE, OFF_EVERY_S, OFF_RESERVATION, RESERVATION};
pub use pace::Paced;
use read::{Kept, Queue};
/// How long a job pinned to a GPU but not yet started keeps its slot there: Slurm's next pass
/// starts it within a second or two. Past this (the slot was taken meanwhile, or the pin is
/// left from an earlier run of the job), it is claimed again.
pub const PIN_GRACE: Duration = Duration::from_secs(30);

/// Whether a gated job waits for its first claim: Slurm's scheduler found the gate's license
/// the only thing it lacks (`Licenses`), or has not looked at it yet (`None`, for up to a
/// second after its submission). Slurm sets a dependency's, a begin time's and a hold's
/// reasons when the job is submitted (22.05 and 24.11), so a job waiting for one of them is
/// left to wait.
fn waits_for_first_claim(job: &Job) -> bool {
    job.gated(LICENSE) && matches!(job.reason.as_str(), "Licenses" | "None")
}

/// Whether a claim pinned the job: through the gate, to a GPU type and a node.
fn pinned(job: &Job) -> bool {
    !job.gated(LICENSE) && job.gres_type().is_some() && job.node.is_some()
}

/// Whether a job pinned past [`PIN_GRACE`] may start sooner pinned again: its slot was taken
/// (`Resources`, `Priority`), its node left (`ReqNodeNotAvail, ...`), Slurm requeued it
/// (`BeginTime`, which the claim's `StartTime=now` ends) or has not looked at it since the
/// claim (`None`, or the gate's `Licenses` still shown). One held, waiting for a dependency,
/// or for a limit of its account or QOS, waits for that wherever it is pinned: claimed again,
/// it would cost slurmctld an update every [`PIN_GRACE`] for as long as it waits, so it keeps
/// its pin and no slot.
fn pin_may_help(job: &Job) -> bool {
    matches!(
        job.reason.as_str(),
        "Resources" | "Priority" | "BeginTime" | "None" | "Licenses"
    ) || job.reason.starts_with("ReqNodeNotAvail")
}

/// What one look did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Looked {
    /// Jobs pinned: (job, node, gres type).
    pub claimed: Vec<(u32, String, String)>,
    /// Jobs let through the gate to fail with their reason.
    pub refused: Vec<(u32, String)>,
    /// Claims that came too late (the job started, ended or left meanwhile).
    pub too_late: Vec<u32>,
    /// The gate was found switched off (`Some(true)`: this look neither gated nor claimed)
    /// or on again (`Some(false)`) since the look before.
    pub switched: Option<bool>,
    /// This daemon took the claimers' lease (`Some(true)`) or stands by (`Some(false)`: it
    /// neither gated nor claimed), where that changed since the look before.
    pub leading: Option<bool>,
    /// What spacing the queue's reads by their cost to slurmctld has to say ([`pace`]).
    pub paced: Option<Paced>,
}

/// The claimer's state between looks.
///
/// Its clock is seconds of a steady clock, as each look is given it (the claimer's thread
/// counts from its start, the simulator its simulated time).
pub struct Claimer {
    config: ClaimConfig,
    gate: gate::Keeper,
    /// Its part in the claimers' election, where it stands for the lease (`None`: it claims
    /// alone), and whether it led at its last look.
    election: Option<Election>,
    leading: Option<bool>,
    /// The node list, as last read.
    nodes: Option<nodes::NodeList>,
    /// Slurm's books as the last look left them ([`Board`]).
    board: Option<Kept>,
    /// What the choice keeps between looks: passed-over jobs, pairs being tried.
    memory: Memory,
    /// Jobs pinned (by this claimer or before), since when they were first seen pinned and
    /// waiting.
    pinned_since: HashMap<u32, f64>,
    /// Which GPU running jobs with no GPU type (started on Slurm's own choice) hold: asked once.
    untyped: HashMap<u32, Option<u32>>,
    /// Host lists jobs asked for or excluded, expanded (`scontrol show hostnames`, no RPC).
    hostlists: HashMap<String, Vec<String>>,
    /// A waiting job found none of its nodes up in the node list: read it again soon.
    nodes_unsettled: bool,
    /// When the queue is read again ([`pace`]).
    pace: pace::Pace,
}

impl Claimer {
    /// A pair never tried that a claim put together waits this long after its trial left
    /// Slurm's books for the history to learn how it went (default: at once).
    pub fn outcome_after(mut self, seconds: f64) -> Claimer {
        self.memory = Memory::new(seconds);
        self
    }

    /// Stands for the claimers' lease as the daemon of `node` ([`Election`]): it claims only
    /// while it holds it, and stands by otherwise.
    pub fn stands_by(mut self, node: &str) -> Claimer {
        self.election = Some(Election::new(node));
        self
    }

    pub fn new(config: ClaimConfig, license_count: u32) -> Claimer {
        Claimer {
            pace: pace::Pace::new(config.slurmctld_percent),
            config,
            gate: gate::Keeper::new(license_count),
            election: None,
            leading: None,
            nodes: None,
            board: None,
            memory: Memory::default(),
            pinned_since: HashMap::new(),
            untyped: HashMap::new(),
            hostlists: HashMap::new(),
            nodes_unsettled: false,
        }
    }

    /// When the next pair being tried is due to have its outcome learned, if one is: a look
    /// then may claim what waited for it.
    pub fn next_trial_end(&self) -> Option<f64> {
        self.memory.trials.next_end()
    }

    /// One look at `now`: the gate, the queue, the claims. `scorer` is this daemon's node:
    /// its history scores, and its GPUs say how much memory each GPU model has.
    pub fn look(&mut self, slurm: &dyn Slurm, scorer: &dyn Scorer, now: f64) -> Result<Looked, SlurmError> {
        let leads = match self.election.as_mut() {
            Some(e) => e.leads(slurm, now)?,
            None => true,
        };
        // What the election read of Slurm's reservations this look, for the off switch.
        let listed = self.election.as_mut().and_then(Election::take_listed);
        let leading = (self.leading != Some(leads)).then_some(leads);
        self.leading = Some(leads);
        if !leads {
            return Ok(Looked {
                leading,
                ..Looked::default()
            });
        }
        let lease_s = self.config.lease_s;
        let (off, switched) = self.gate.switched_off(slurm, lease_s, now, listed.as_deref())?;
        if off {
            return Ok(Looked {
                switched,
                leading,
                ..Looked::default()
            });
        }
        self.gate.hold(slurm, lease_s, now)?;
        if !self.pace.due(now) {
            return Ok(Looked {
                switched,
                leading,
                ..Looked::default()
            });
        }
        let started = std::time::Instant::now();
        // The board is taken for the look and kept only if the look ends well: after a
        // failure, the next look starts again from every job.
        let board = self.board.take();
        let (queue, mut kept) = self.read(slurm, scorer, board, now)?;
        let paced = self.pace.read(slurm, now, started.elapsed());
        let looked = if queue.candidates.is_empty() {
            Looked::default()
        } else {
            self.choose_and_claim(slurm, scorer, &mut kept.board, &queue, now)?
        };
        kept.board.end_look();
        self.board = Some(kept);
        Ok(Looked {
            switched,
            leading,
            paced,
            ..looked
        })
    }

    /// The look's claims on `board`, made.
    fn choose_and_claim(
        &mut self,
        slurm: &dyn Slurm,
        scorer: &dyn Scorer,
        board: &mut Board,
        queue: &Queue,
        now: f64,
    ) -> Result<Looked, SlurmError> {
        board.measured(scorer.app_memory().map_err(SlurmError::Failed)?);
        let pending: Vec<Candidate> = (queue.candidates.iter())
            .map(|(c, _)| Candidate {
                mem_mb: board.memory_of(c.mem_mb, &c.app),
                ..c.clone()
            })
            .collect();
        let mut estimates = scorer
            .estimates(&crate::claim::wanted(board, &pending))
            .map_err(SlurmError::Failed)?;
        let choices = crate::claim::choose_on(
            board,
            &pending,
            queue.waiting,
            &mut estimates,
            scorer.knobs(),
            &mut self.memory,
            now,
        );
        self.carry_out(slurm, board.nodes(), queue, choices, now)
    }

    /// Makes the claims and refusals chosen, one update each, in order.
    fn carry_out(
        &mut self,
        slurm: &dyn Slurm,
        nodes: &[NodeGpus],
        queue: &Queue,
        choices: Vec<Choice>,
        now: f64,
    ) -> Result<Looked, SlurmError> {
        let mut looked = Looked::default();
        for choice in choices {
            let (job, result) = match choice {
                Choice::Pin {
                    job,
                    node: n,
                    gpu,
                    partners,
                    predicted_speed,
                    ..
                } => {
                    let index = queue.candidates[job].1;
                    let claim = (&nodes[n], gpu, partners, predicted_speed);
                    let job = &queue.jobs[index];
                    (job, self.pin(slurm, job, queue.specs[index].as_ref(), claim, now))
                }
                Choice::Refuse { job, reason } => {
                    let job = &queue.jobs[queue.candidates[job].1];
                    (job, refuse(slurm, job, reason))
                }
            };
            match result {
                Ok(Some(Done::Claimed(node, kind))) => looked.claimed.push((job.id, node, kind)),
                Ok(Some(Done::Refused(reason))) => looked.refused.push((job.id, reason)),
                Ok(None) => {}
                Err(SlurmError::NotPending(id)) => looked.too_late.push(id),
                Err(e) => return Err(e),
            }
        }
        Ok(looked)
    }

    /// What a job of the queue is to this look: one holding (or pinned to, within
    /// [`PIN_GRACE`]) a GPU, a multiplexed job waiting for a claim, or neither.
    fn classify<'s>(&mut self, slurm: &dyn Slurm, job: &'s Job, spec: Option<&'s Spec>, now: f64) -> Seen<'s> {
        let pinned = pinned(job);
        if job.pending && pinned {
            // Put back by its node's daemon since its claim: its pin is stale at once.
            let put_back = multiplex_protocol::spec::put_back_since_claim(job.admin_comment.as_deref());
            let since = *self.pinned_since.entry(job.id).or_insert(now);
            if !put_back && now - since < PIN_GRACE.as_secs_f64() {
                let gpu = job.gres_type().and_then(split_gpu_type).map(|(m, i)| (Some(m), i));
                return Seen::Resident(gpu);
            }
            if !pin_may_help(job) {
                return Seen::Other;
            }
        }
        if !job.pending {
            let gpu = match job.gres_type() {
                Some(t) => split_gpu_type(t).map(|(model, index)| (Some(model), index)),
                None => match self.untyped.get(&job.id) {
                    Some(&known) => known,
                    // Asked once; a failed ask is asked again at the next look.
                    None => match slurm.job_gpu(job.id) {
                        Ok(index) => *self.untyped.entry(job.id).or_insert(index),
                        Err(_) => None,
                    },
                }
                .map(|index| (None, index)),
            };
            return Seen::Resident(gpu);
        }
        // A multiplexed job that waits only for the gate (or for a pin that went stale).
        match spec {
            Some(spec) if waits_for_first_claim(job) || pinned => Seen::Waiting(spec),
            _ => Seen::Other,
        }
    }

    /// A waiting job as the choice weighs it; `None` while none of the nodes it may run on is
    /// up in this look's node list (a slurmd not registered yet, a node down or drained, one
    /// the list does not know): it waits for one, and the list is read again soon. Refused
    /// for good, it would be let through unclaimed.
    fn candidate(
        &mut self,
        slurm: &dyn Slurm,
        job: &Job,
        spec: &Spec,
        infos: &[NodeInfo],
        merges: bool,
    ) -> Option<Candidate> {
        // The claim keeps within the nodes the job's user asked for: while it waits for its
        // first claim, its own node list (as its user or an admin set it); once pinned, the
        // list is the claimer's own, and the tag's record of the user's (job_submit, from
        // --nodelist) stands in. Its --exclude is never replaced.
        let asked = if pinned(job) {
            spec.nodes.as_deref()
        } else {
            job.node.as_deref()
        };
        let nodes = self.allowed_nodes(slurm, asked, job.excluded.as_deref(), infos);
        let up = |n: &str| infos.iter().any(|i| i.name == n && i.usable());
        let any_up = match &nodes {
            Some(list) => list.iter().any(|n| up(n)),
            None => infos.iter().any(NodeInfo::usable),
        };
        if !any_up {
            self.nodes_unsettled = true;
            return None;
        }
        Some(Candidate {
            job_id: job.id,
            app: spec.app.clone().unwrap_or_default(),
            mem_mb: spec.mem_mb,
            model: spec.model.clone(),
            // Where Slurm merges gres updates, a typed job keeps its GPU index.
            gpu: job
                .gres_type()
                .filter(|_| merges)
                .and_then(split_gpu_type)
                .map(|(_, index)| index),
            nodes,
            put_back: multiplex_protocol::spec::put_back_beside(job.admin_comment.as_deref()),
        })
    }

    /// Pins `job` to `gpu` of `target` in one update, with the claim as a record after its
    /// tag; `None` where the GPU is not in this look's list.
    fn pin(
        &mut self,
        slurm: &dyn Slurm,
        job: &Job,
        spec: Option<&Spec>,
        (target, gpu, partners, predicted_speed): (&NodeGpus, u32, Vec<u32>, f64),
        now: f64,
    ) -> Result<Option<Done>, SlurmError> {
        let Some(kind) = target
            .gpus
            .iter()
            .find(|g| g.index == gpu)
            .map(|g| gpu_type(&g.model, gpu))
        else {
            return Ok(None);
        };
        // A job srun made itself is claimed for the node only (`pin=node` in its tag): Slurm
        // picks its GPU there, and it is counted where it lands.
        let node_only = spec.is_some_and(|s| s.node_only);
        let claim = Claim {
            node: target.node.clone(),
            gpu: (!node_only).then(|| kind.clone()),
            partners,
            predicted_speed,
        };
        let pin = Pin {
            job: job.id,
            node: target.node.clone(),
            gres: (!node_only).then(|| format!("shard:{kind}:{}", job.gres_count())),
            untyped: job.gres_type().is_none(),
            licenses: without_gate(&job.licenses),
            admin_comment: with_note(job.admin_comment.as_deref().unwrap_or_default(), &claim.to_string()),
            // A pinned job held for a begin time: one Slurm requeued.
            start_now: job.reason == "BeginTime" && !job.gated(LICENSE),
        };
        slurm.claim(&pin)?;
        self.pinned_since.insert(job.id, now);
        Ok(Some(Done::Claimed(target.node.clone(), kind)))
    }
}

/// What a job of the queue is to one look.
enum Seen<'s> {
    /// It holds a slot: (its GPU's model where known, its index), if known.
    Resident(Option<(Option<&'s str>, u32)>),
    /// Multiplexed, waiting for a claim.
    Waiting(&'s Spec),
    Other,
}

/// What became of a choice.
enum Done {
    Claimed(String, String),
    Refused(String),
}

/// Lets a job no GPU could ever hold through the gate, to fail with `reason`.
fn refuse(slurm: &dyn Slurm, job: &Job, reason: String) -> Result<Option<Done>, SlurmError> {
    let comment = with_note(
        job.admin_comment.as_deref().unwrap_or_default(),
        &format!("refused: {reason}"),
    );
    slurm.release(job.id, &without_gate(&job.licenses), &comment)?;
    Ok(Some(Done::Refused(reason)))
}

/// A job's licenses without the gate's.
pub fn without_gate(licenses: &str) -> String {
    licenses
        .split(',')
        .map(str::trim)
        .filter(|l| !l.is_empty() && l.split([':', '=']).next() != Some(LICENSE))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, GpuSpec};
    use crate::node::Node;
    use crate::slurm::{Fake, FakeState, Gate};
    use nodes::NODES_AGAIN;
    use std::sync::Mutex;

    fn daemon() -> Mutex<Node> {
        let config = Config::parse("node = \"n1\"\ndatabase = \":memory:\"\njobs_per_gpu = 2\n").unwrap();
        let gpus = vec![GpuSpec {
            index: 0,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        }];
        Mutex::new(Node::open(config, gpus, Box::new(|| 0.0)).unwrap())
    }

    fn gated(id: u32, app: &str) -> Job {
        Job {
            id,
            pending: true,
            reason: "Licenses".into(),
            node: None,
            excluded: None,
            gres: "shard:1".into(),
            licenses: "multiplex:1".into(),
            admin_comment: Some(format!("multiplex:app={app}")),
        }
    }

    fn running(id: u32, app: &str, node: &str, kind: &str) -> Job {
        Job {
            pending: false,
            reason: "None".into(),
            node: Some(node.into()),
            gres: if kind.is_empty() {
                "shard:1".into()
            } else {
                format!("shard:{kind}:1")
            },
            licenses: String::new(),
            ..gated(id, app)
        }
    }

    fn nodes() -> Vec<NodeInfo> {
        ["n1", "n2"]
            .iter()
            .map(|n| NodeInfo {
                name: n.to_string(),
                state: "idle".into(),
                gres: "gpu:v100_0:1,gpu:v100_1:1,shard:v100_0:2,shard:v100_1:2".into(),
            })
            .collect()
    }

    fn config() -> ClaimConfig {
        ClaimConfig {
            enabled: true,
            ..ClaimConfig::default()
        }
    }

    #[test]
    fn where_slurm_merges_gres_updates_a_first_claim_is_two_updates_and_a_typed_job_keeps_its_index() {
        // A job pinned to v100_1 of n1 long ago that never started (its slot went): claimed
        // again, onto index 1 of whichever node. A fresh job: cleared, then pinned.
        let stale = Job {
            reason: "Resources".into(),
            node: Some("n1".into()),
            gres: "shard:v100_1:1".into(),
            licenses: String::new(),
            ..gated(1, "a")
        };
        let slurm = fake(vec![
            running(9, "a", "n1", "v100_1"),
            running(10, "a", "n1", "v100_1"),
            stale,
            gated(2, "b"),
        ]);
        slurm.state.lock().unwrap().merges = true;
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let t0 = 0.0;
        c.look(&slurm, &node, t0).unwrap();
        let looked = c.look(&slurm, &node, t0 + PIN_GRACE.as_secs_f64() + 1.0).unwrap();
        let again = looked.claimed.iter().find(|(j, _, _)| *j == 1).expect("claimed again");
        assert_eq!((again.1.as_str(), again.2.as_str()), ("n2", "v100_1"), "{looked:?}");
        let s = slurm.state.lock().unwrap();
        let pins: Vec<(u32, bool)> = s.claims.iter().map(|p| (p.job, p.untyped)).collect();
        // Job 2 cleared and pinned (two updates) on the first look; on the second, job 1
        // and job 2 (its pin now stale too) each pinned again, typed, in one update.
        assert_eq!(pins, vec![(2, true), (1, false), (2, false)]);
        assert_eq!(s.updates, 1 + 2 + 1 + 1);
    }

    #[test]
    fn the_board_kept_between_looks_follows_every_read_of_the_queue() {
        // Two nodes of two GPUs. Jobs 1 and 2 run on n1's GPUs, job 3 on n2's GPU 1: job 4
        // takes the one idle GPU.
        let slurm = fake(vec![
            running(1, "a", "n1", "v100_0"),
            running(2, "a", "n1", "v100_1"),
            running(3, "a", "n2", "v100_1"),
            gated(4, "a"),
        ]);
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let pin = |job: u32, node: &str, kind: &str| vec![(job, node.to_string(), kind.to_string())];
        assert_eq!(c.look(&slurm, &node, 0.0).unwrap().claimed, pin(4, "n2", "v100_0"));
        // Job 3 ended and job 4 runs where it was claimed: job 5 takes job 3's GPU, idle
        // again, not a share of n1's first GPU (as it would were job 3 kept on the board).
        slurm.state.lock().unwrap().jobs = vec![
            running(1, "a", "n1", "v100_0"),
            running(2, "a", "n1", "v100_1"),
            running(4, "a", "n2", "v100_0"),
            gated(5, "a"),
        ];
        assert_eq!(c.look(&slurm, &node, 1.0).unwrap().claimed, pin(5, "n2", "v100_1"));
    }

    #[test]
    fn a_job_slurm_requeued_is_claimed_again_once_its_pin_is_stale_and_may_start_at_once() {
        // Given back by the separation look: pending again, pinned, held for Slurm's requeue
        // delay (Reason=BeginTime).
        let requeued = Job {
            reason: "BeginTime".into(),
            node: Some("n1".into()),
            gres: "shard:v100_1:1".into(),
            licenses: String::new(),
            ..gated(1, "a")
        };
        let slurm = fake(vec![requeued.clone()]);
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let t0 = 0.0;
        assert!(
            c.look(&slurm, &node, t0).unwrap().claimed.is_empty(),
            "its pin is fresh"
        );
        let looked = c.look(&slurm, &node, t0 + PIN_GRACE.as_secs_f64() + 1.0).unwrap();
        assert_eq!(looked.claimed.len(), 1, "{looked:?}");
        let s = slurm.state.lock().unwrap();
        assert!(s.claims[0].start_now, "{:?}", s.claims[0]);
        drop(s);
        // A job that only waits for the gate never has its begin time touched.
        let slurm = fake(vec![gated(2, "a")]);
        c.look(&slurm, &node, t0 + PIN_GRACE.as_secs_f64() + 2.0).unwrap();
        assert!(!slurm.state.lock().unwrap().claims[0].start_now);
        // Put back by its daemon since its claim (the note after the claim's), it is claimed
        // again at once, and at once again if put back again.
        let mut c = Claimer::new(config(), 1);
        let put_back = |claim: &str| Job {
            admin_comment: Some(format!(
                "multiplex:app=a | multiplex: {claim} | multiplex: {}",
                multiplex_protocol::spec::put_back_note("b", "n1", "1")
            )),
            ..requeued.clone()
        };
        let slurm = fake(vec![put_back("claim node:n1 gpu:v100_1 beside:2 speed:0.70")]);
        assert_eq!(c.look(&slurm, &node, t0).unwrap().claimed.len(), 1);
    }

    #[test]
    fn a_job_srun_made_is_claimed_for_a_node_only_and_keeps_its_gres() {
        let srun_made = Job {
            admin_comment: Some("multiplex:app=a,pin=node".into()),
            ..gated(1, "a")
        };
        let slurm = fake(vec![srun_made]);
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let looked = c.look(&slurm, &node, 0.0).unwrap();
        assert_eq!(looked.claimed.len(), 1, "{looked:?}");
        let s = slurm.state.lock().unwrap();
        let pin = &s.claims[0];
        assert_eq!((pin.gres.as_deref(), pin.licenses.as_str()), (None, ""), "{pin:?}");
        let claim = Claim::from_comment(Some(&pin.admin_comment)).unwrap().unwrap();
        assert_eq!((claim.node.as_str(), claim.gpu), ("n1", None), "{pin:?}");
        assert_eq!(s.jobs[0].gres, "shard:1");
    }

    fn fake(jobs: Vec<Job>) -> Fake {
        Fake::new(FakeState {
            jobs,
            nodes: nodes(),
            licenses: 100_000,
            ..FakeState::default()
        })
    }

    #[test]
    fn a_burst_is_pinned_one_job_per_gpu_over_both_nodes_in_one_update_each() {
        let slurm = fake((1..=4).map(|i| gated(i, "a")).collect());
        let node = daemon();
        let mut c = Claimer::new(config(), 100_000);
        let looked = c.look(&slurm, &node, 0.0).unwrap();
        let mut gpus: Vec<(String, String)> = looked.claimed.iter().map(|(_, n, k)| (n.clone(), k.clone())).collect();
        gpus.sort();
        let want: Vec<(String, String)> = [("n1", "v100_0"), ("n1", "v100_1"), ("n2", "v100_0"), ("n2", "v100_1")]
            .iter()
            .map(|(n, k)| (n.to_string(), k.to_string()))
            .collect();
        assert_eq!(gpus, want);
        let s = slurm.state.lock().unwrap();
        // The gate held, the queue and the node list read once, what jobs hold whole once, one
        // update per job.
        assert_eq!(s.gate_until, Some(300));
        assert_eq!((s.reads, s.updates), (3, 1 + 4));
        for pin in &s.claims {
            assert_eq!(pin.licenses, "", "the gate's license is dropped");
            assert!(
                pin.gres.as_deref().is_some_and(|g| g.starts_with("shard:v100_")),
                "{pin:?}"
            );
            assert!(
                pin.admin_comment
                    .starts_with("multiplex:app=a | multiplex: claim node:n"),
                "{pin:?}"
            );
            let claim = Claim::from_comment(Some(&pin.admin_comment)).unwrap().unwrap();
            assert_eq!(Some(&claim.node), Some(&pin.node), "{pin:?}");
            assert_eq!(claim.gpu.map(|g| format!("shard:{g}:1")), pin.gres, "{pin:?}");
            assert_eq!((claim.partners, claim.predicted_speed), (vec![], 1.0), "{pin:?}");
        }
    }

    #[test]
    fn the_jobs_waiting_beyond_the_lookahead_count_towards_the_queue_a_share_needs() {
        // 16 GPUs each running an `a`; a newcomer `a` beside one gains 0.4 by the prior, so a
        // share takes more than 0.25 x 16 x 0.6 = 2.4 jobs waiting (`policy.share_queue`'s
        // default). The claimer weighs one job a look, and counts the rest of the queue.
        let running_all: Vec<Job> = (0..16)
            .map(|i| running(100 + i, "a", &format!("n{}", i / 2), &format!("v100_{}", i % 2)))
            .collect();
        let look = |waiting: u32| {
            let mut jobs = running_all.clone();
            jobs.extend((1..=waiting).map(|i| gated(i, "a")));
            let slurm = fake(jobs);
            slurm.state.lock().unwrap().nodes = (0..8)
                .map(|n| NodeInfo {
                    name: format!("n{n}"),
                    ..nodes()[0].clone()
                })
                .collect();
            let mut c = Claimer::new(
                ClaimConfig {
                    lookahead: 1,
                    ..config()
                },
                100_000,
            );
            c.look(&slurm, &daemon(), 0.0).unwrap().claimed
        };
        assert_eq!(look(2), vec![]);
        let claimed = look(3);
        assert_eq!(claimed.len(), 1, "{claimed:?}");
        assert_eq!(claimed[0].0, 1, "the first in Slurm's order");
    }

    #[test]
    fn a_gpu_a_job_holds_whole_takes_no_claim() {
        // Plain jobs hold n1's GPU 0 and both of n2's whole: of four waiting jobs, two go to
        // the one GPU left (two shards), two wait.
        let slurm = fake((1..=4).map(|i| gated(i, "a")).collect());
        slurm.state.lock().unwrap().held_whole = [("n1", "v100_0"), ("n2", "v100_0"), ("n2", "v100_1")]
            .iter()
            .map(|(n, k)| (n.to_string(), k.to_string()))
            .collect();
        let node = daemon();
        let mut c = Claimer::new(config(), 100_000);
        let looked = c.look(&slurm, &node, 0.0).unwrap();
        let gpus: Vec<(&str, &str)> = looked
            .claimed
            .iter()
            .map(|(_, n, k)| (n.as_str(), k.as_str()))
            .collect();
        assert_eq!(gpus, [("n1", "v100_1"), ("n1", "v100_1")]);
        // Once n2's GPUs are given back, the jobs still waiting go there.
        slurm.state.lock().unwrap().held_whole.truncate(1);
        let looked = c.look(&slurm, &node, 1.0).unwrap();
        let mut gpus: Vec<(&str, &str)> = looked
            .claimed
            .iter()
            .map(|(_, n, k)| (n.as_str(), k.as_str()))
            .collect();
        gpus.sort_unstable();
        assert_eq!(gpus, [("n2", "v100_0"), ("n2", "v100_1")]);
    }

    #[test]
    fn a_pinned_job_keeps_its_slot_until_slurm_starts_it_and_is_claimed_again_when_it_does_not() {
        let slurm = fake(vec![
            running(1, "a", "n1", "v100_0"),
            running(2, "a", "n1", "v100_1"),
            running(3, "a", "n2", "v100_0"),
            gated(4, "a"),
        ]);
        let node = daemon();
        let mut c = Claimer::new(config(), 100_000);
        let t0 = 0.0;
        let first = c.look(&slurm, &node, t0).unwrap();
        assert_eq!(first.claimed, vec![(4, "n2".into(), "v100_1".into())], "the idle GPU");
        // Slurm has not started it yet: its slot is taken, the next job shares.
        slurm.state.lock().unwrap().jobs.push(gated(5, "a"));
        let second = c.look(&slurm, &node, t0 + 1.0).unwrap();
        assert_eq!(second.claimed.len(), 1);
        assert_ne!(second.claimed[0].0, 4);
        // Still waiting past the grace (its slot was taken meanwhile): claimed again.
        let third = c.look(&slurm, &node, t0 + PIN_GRACE.as_secs_f64() + 2.0).unwrap();
        assert!(third.claimed.iter().any(|(j, _, _)| *j == 4), "{third:?}");
    }

    #[test]
    fn a_claim_that_comes_too_late_is_no_failure() {
        let slurm = fake(vec![gated(7, "a")]);
        let node = daemon();
        let mut c = Claimer::new(config(), 100_000);
        // Slurm starts it (the gate lapsed) between the read and the claim: the fake's jobs
        // are read, then the job stops pending.
        struct Racing(Fake);
        impl Slurm for Racing {
            fn merges_gres_updates(&self) -> Result<bool, SlurmError> {
                self.0.merges_gres_updates()
            }
            fn jobs(&self, p: &str) -> Result<Vec<Job>, SlurmError> {
                let jobs = self.0.jobs(p)?;
                self.0.state.lock().unwrap().jobs[0].pending = false;
                Ok(jobs)
            }
            fn nodes(&self, p: &str) -> Result<Vec<NodeInfo>, SlurmError> {
                self.0.nodes(p)
            }
            fn claim(&self, pin: &Pin) -> Result<(), SlurmError> {
                self.0.claim(pin)
            }
            fn hold_gate(&self, g: &Gate, l: u64) -> Result<(), SlurmError> {
                self.0.hold_gate(g, l)
            }
            fn reservations(&self) -> Result<Vec<crate::slurm::Reservation>, SlurmError> {
                self.0.reservations()
            }
            fn take_lease(&self, n: &str, l: &str, s: u64) -> Result<bool, SlurmError> {
                self.0.take_lease(n, l, s)
            }
            fn renew_lease(&self, n: &str, s: u64) -> Result<bool, SlurmError> {
                self.0.renew_lease(n, s)
            }
            fn delete_reservation(&self, n: &str) -> Result<(), SlurmError> {
                self.0.delete_reservation(n)
            }
            fn switch_gate(&self, g: &Gate, on: bool) -> Result<(), SlurmError> {
                self.0.switch_gate(g, on)
            }
            fn release(&self, j: u32, l: &str, c: &str) -> Result<(), SlurmError> {
                self.0.release(j, l, c)
            }
            fn requeue(&self, j: u32) -> Result<(), SlurmError> {
                self.0.requeue(j)
            }
            fn job_record(&self, j: u32) -> Result<crate::slurm::JobRecord, SlurmError> {
                self.0.job_record(j)
            }
            fn set_admin_comment(&self, j: u32, c: &str) -> Result<(), SlurmError> {
                self.0.set_admin_comment(j, c)
            }
            fn running_here(&self, n: &str) -> Result<std::collections::HashSet<u32>, SlurmError> {
                self.0.running_here(n)
            }
            fn private_jobs(&self) -> Result<bool, SlurmError> {
                self.0.private_jobs()
            }
            fn node_record(&self, n: &str) -> Result<crate::slurm::NodeRecord, SlurmError> {
                self.0.node_record(n)
            }
            fn hostnames(&self, l: &str) -> Result<Vec<String>, SlurmError> {
                self.0.hostnames(l)
            }
            fn job_nodes(&self, j: u32) -> Result<Option<String>, SlurmError> {
                self.0.job_nodes(j)
            }
            fn job_gpu(&self, j: u32) -> Result<Option<u32>, SlurmError> {
                self.0.job_gpu(j)
            }
            fn license_total(&self, n: &str) -> Result<u32, SlurmError> {
                self.0.license_total(n)
            }
        }
        let looked = c.look(&Racing(slurm), &node, 0.0).unwrap();
        assert_eq!((looked.claimed.len(), looked.too_late), (0, vec![7]));
    }

    #[test]
    fn a_job_is_claimed_only_onto_the_nodes_its_user_asked_for() {
        let on_n2 = Job {
            node: Some("n2".into()),
            ..gated(1, "a")
        };
        let not_n1 = Job {
            excluded: Some("n1".into()),
            ..gated(2, "a")
        };
        let slurm = fake(vec![on_n2, not_n1]);
        let looked = Claimer::new(config(), 1).look(&slurm, &daemon(), 0.0).unwrap();
        assert!(looked.claimed.iter().all(|(_, n, _)| n == "n2"), "{looked:?}");
        assert_eq!(looked.claimed.len(), 2);
    }

    #[test]
    fn a_requeued_job_is_claimed_again_within_the_nodes_its_user_asked_for() {
        // Claimed onto n1's GPU 1 before, requeued: the job's node list is now the claim's
        // (n1), and its tag keeps what its user asked for (n1 or n2, written n1+n2).
        let requeued = |id, nodes: &str| Job {
            reason: "BeginTime".into(),
            node: Some("n1".into()),
            gres: "shard:v100_1:1".into(),
            licenses: String::new(),
            admin_comment: Some(format!(
                "multiplex:app=a,nodes={nodes} | multiplex: claim node:n1 gpu:v100_1 beside:- speed:1.00"
            )),
            ..gated(id, "a")
        };
        // n1 is full; n2 idle: a user who allowed n2 is claimed there, one who asked for n1
        // alone waits for n1.
        let mut jobs: Vec<Job> = (0..4)
            .map(|k| running(8 + k, "b", "n1", if k < 2 { "v100_0" } else { "v100_1" }))
            .collect();
        jobs.push(requeued(1, "n1+n2"));
        jobs.push(requeued(2, "n1"));
        let slurm = fake(jobs);
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let t0 = 0.0;
        c.look(&slurm, &node, t0).unwrap();
        let looked = c.look(&slurm, &node, t0 + PIN_GRACE.as_secs_f64() + 1.0).unwrap();
        let on: Vec<(u32, &str)> = looked.claimed.iter().map(|(j, n, _)| (*j, n.as_str())).collect();
        assert_eq!(on, [(1, "n2")], "job 2 waits for n1: {looked:?}");
    }

    #[test]
    fn a_job_whose_nodes_are_not_up_yet_waits_and_is_claimed_once_they_are() {
        // The claimer's first look finds n2's slurmd not registered yet (a cluster starting):
        // a job asking for n2, and any job while no node is up, waits rather than being
        // refused for good and let through unclaimed.
        let on_n2 = Job {
            node: Some("n2".into()),
            ..gated(1, "a")
        };
        let slurm = fake(vec![on_n2]);
        slurm.state.lock().unwrap().nodes[1].state = "unknown*".into();
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let t0 = 0.0;
        let looked = c.look(&slurm, &node, t0).unwrap();
        assert!(looked.claimed.is_empty() && looked.refused.is_empty(), "{looked:?}");
        // n2 registers; the node list is read again within NODES_AGAIN, not NODES_EVERY.
        slurm.state.lock().unwrap().nodes[1].state = "idle".into();
        let looked = c.look(&slurm, &node, t0 + NODES_AGAIN.as_secs_f64()).unwrap();
        assert_eq!(
            looked
                .claimed
                .iter()
                .map(|(j, n, _)| (*j, n.as_str()))
                .collect::<Vec<_>>(),
            [(1, "n2")]
        );
        // A node that comes up is used within NODES_AGAIN too, though every job could run
        // elsewhere: a burst right after a cluster starts spreads over both nodes.
        let slurm = fake(vec![]);
        slurm.state.lock().unwrap().nodes[0].state = "unknown*".into();
        let mut c = Claimer::new(config(), 1);
        c.look(&slurm, &node, t0).unwrap();
        {
            let mut s = slurm.state.lock().unwrap();
            s.nodes[0].state = "idle".into();
            s.jobs = (11..=14).map(|i| gated(i, "b")).collect();
        }
        let looked = c.look(&slurm, &node, t0 + NODES_AGAIN.as_secs_f64()).unwrap();
        let mut gpus: Vec<(&str, &str)> = looked
            .claimed
            .iter()
            .map(|(_, n, g)| (n.as_str(), g.as_str()))
            .collect();
        gpus.sort_unstable();
        assert_eq!(
            gpus,
            [("n1", "v100_0"), ("n1", "v100_1"), ("n2", "v100_0"), ("n2", "v100_1")],
            "{looked:?}"
        );
        // With no node up at all, nothing is refused either.
        let slurm = fake(vec![gated(2, "a")]);
        for n in &mut slurm.state.lock().unwrap().nodes {
            n.state = "down*".into();
        }
        let looked = Claimer::new(config(), 1).look(&slurm, &node, t0).unwrap();
        assert!(looked.claimed.is_empty() && looked.refused.is_empty(), "{looked:?}");
    }

    #[test]
    fn only_jobs_that_wait_for_the_gate_alone_are_claimed() {
        let waiting = |id, reason: &str| Job {
            reason: reason.into(),
            ..gated(id, "a")
        };
        let plain = Job {
            admin_comment: None,
            ..gated(2, "a")
        };
        // Slurm's scheduler has not looked at job 4 yet (just submitted): claimed too.
        let slurm = fake(vec![
            waiting(1, "Dependency"),
            plain,
            gated(3, "a"),
            waiting(4, "None"),
            waiting(5, "JobHeldUser"),
            waiting(6, "BeginTime"),
        ]);
        let looked = Claimer::new(config(), 1).look(&slurm, &daemon(), 0.0).unwrap();
        assert_eq!(looked.claimed.iter().map(|c| c.0).collect::<Vec<_>>(), vec![3, 4]);
    }

    #[test]
    fn a_stale_pin_that_waits_for_its_own_reasons_is_not_claimed_again() {
        // Pinned long ago and not started: held by its user, waiting for a dependency or for
        // its QOS's limit. A new pin would not start them sooner, and each would cost an
        // update every PIN_GRACE; they keep their pins, and hold no slot meanwhile.
        let pinned = |id, reason: &str| Job {
            reason: reason.into(),
            node: Some("n1".into()),
            gres: "shard:v100_0:1".into(),
            licenses: String::new(),
            ..gated(id, "a")
        };
        let slurm = fake(vec![
            pinned(1, "JobHeldUser"),
            pinned(2, "Dependency"),
            pinned(3, "QOSMaxJobsPerUserLimit"),
            pinned(4, "ReqNodeNotAvail, UnavailableNodes:n1"),
        ]);
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let t0 = 0.0;
        assert!(c.look(&slurm, &node, t0).unwrap().claimed.is_empty(), "fresh pins");
        let looked = c.look(&slurm, &node, t0 + PIN_GRACE.as_secs_f64() + 1.0).unwrap();
        // Only the job whose node left is pinned again, where a slot is.
        assert_eq!(
            looked.claimed.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![4],
            "{looked:?}"
        );
        for k in 2..=4 {
            let looked = c
                .look(&slurm, &node, t0 + f64::from(k) * (PIN_GRACE.as_secs_f64() + 1.0))
                .unwrap();
            assert!(looked.claimed.iter().all(|c| c.0 == 4), "look {k}: {looked:?}");
        }
        let s = slurm.state.lock().unwrap();
        assert!(s.claims.iter().all(|p| p.job == 4), "{:?}", s.claims);
    }

    #[test]
    fn a_job_started_on_slurms_own_choice_counts_on_the_gpu_slurmctld_names() {
        // Both GPUs of both nodes hold one job; n2's GPU 1 holds an untyped one.
        let mut jobs = vec![
            running(1, "a", "n1", "v100_0"),
            running(2, "a", "n1", "v100_1"),
            running(3, "a", "n2", "v100_0"),
            running(4, "a", "n2", ""),
            running(5, "a", "n2", "v100_0"),
            running(6, "a", "n1", "v100_0"),
            running(7, "a", "n1", "v100_1"),
        ];
        jobs.push(gated(8, "a"));
        let slurm = fake(jobs);
        slurm.state.lock().unwrap().gpus = vec![(4, 1)];
        let looked = Claimer::new(config(), 1).look(&slurm, &daemon(), 0.0).unwrap();
        assert_eq!(looked.claimed, vec![(8, "n2".into(), "v100_1".into())]);
        // Without it, GPU 1 of n2 would have looked idle: the queue, the node list, job 4's
        // GPU and what jobs hold whole were read.
        assert_eq!(slurm.state.lock().unwrap().reads, 4);
    }

    #[test]
    fn the_gate_is_renewed_every_third_of_its_lease() {
        let slurm = fake(vec![]);
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        let t0 = 0.0;
        for s in [0, 1, 99, 100, 101, 200] {
            c.look(&slurm, &node, t0 + s as f64).unwrap();
        }
        // At 0, 100 and 200 s (a lease of 300 s).
        assert_eq!(slurm.state.lock().unwrap().updates, 3);
    }

    #[test]
    fn where_reading_the_queue_costs_slurmctld_much_the_claimer_reads_it_less_often_and_holds_the_gate_meanwhile() {
        // 2 jobs at 25 ms each: a read costs slurmctld 50 ms, at 1% one every 5 s.
        let slurm = fake(vec![running(1, "a", "n1", "v100_0"), gated(2, "a")]);
        {
            let mut s = slurm.state.lock().unwrap();
            s.read_us_per_job = Some(25_000);
        }
        let node = daemon();
        let mut c = Claimer::new(config(), 1);
        assert_eq!(c.look(&slurm, &node, 0.0).unwrap().claimed.len(), 1);
        slurm.state.lock().unwrap().jobs.push(gated(3, "a"));
        for t in 1..5 {
            let looked = c.look(&slurm, &node, t as f64).unwrap();
            assert!(looked.claimed.is_empty(), "at {t} s: {looked:?}");
        }
        let looked = c.look(&slurm, &node, 5.0).unwrap();
        assert_eq!(looked.claimed.iter().map(|c| c.0).collect::<Vec<_>>(), vec![3]);
        let s = slurm.state.lock().unwrap();
        assert_eq!(s.read_cost.unwrap().reads, 2, "two reads in 5 s");
        // The gate was held all along (renewed on its own clock, not the reads').
        assert!(s.gate_until.is_some_and(|until| until >= 300));
    }

    #[test]
    fn switched_off_no_claimer_gates_or_claims_and_switched_on_it_gates_and_claims_within_seconds() {
        let slurm = fake(vec![gated(1, "a")]);
        let node = daemon();
        let mut c = Claimer::new(config(), 100_000);
        slurm.switch_gate(&gate(100_000), false).unwrap();
        let looked = c.look(&slurm, &node, 0.0).unwrap();
        assert_eq!(looked.switched, Some(true));
        for t in [1.0, 4.0] {
            assert_eq!(c.look(&slurm, &node, t).unwrap(), Looked::default());
        }
        {
            let s = slurm.state.lock().unwrap();
            assert_eq!((s.gate_until, s.claims.len(), s.updates), (None, 0, 1), "{s:?}");
            assert!(s.jobs[0].gated(LICENSE));
            // Asked once, then not again within OFF_EVERY_S; nothing else read.
            assert_eq!((s.reservation_reads, s.reads), (1, 0));
        }
        slurm.switch_gate(&gate(100_000), true).unwrap();
        assert_eq!(c.look(&slurm, &node, 4.5).unwrap(), Looked::default());
        let looked = c.look(&slurm, &node, OFF_EVERY_S).unwrap();
        assert_eq!(looked.switched, Some(false));
        assert_eq!(looked.claimed.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1]);
        assert_eq!(slurm.state.lock().unwrap().gate_until, Some(300));
    }

    #[test]
    fn a_job_no_gpu_could_hold_is_let_through_with_the_reason() {
        let big = Job {
            admin_comment: Some("multiplex:app=big,mem=65536M".into()),
            ..gated(1, "big")
        };
        let slurm = fake(vec![big, gated(2, "a")]);
        let looked = Claimer::new(config(), 1).look(&slurm, &daemon(), 0.0).unwrap();
        assert_eq!(looked.refused.len(), 1);
        assert!(looked.refused[0].1.contains("65536 MiB"), "{:?}", looked.refused);
        let s = slurm.state.lock().unwrap();
        let job = s.jobs.iter().find(|j| j.id == 1).unwrap();
        assert!(!job.gated(LICENSE) && job.node.is_none());
        assert!(job
            .admin_comment
            .as_deref()
            .unwrap()
            .contains("| multiplex: refused: it needs 65536 MiB"));
        assert_eq!(looked.claimed.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn types_and_licenses() {
        assert_eq!(split_gpu_type("v100_1"), Some(("v100", 1)));
        assert_eq!(split_gpu_type("a100_80gb_3"), Some(("a100_80gb", 3)));
        assert_eq!(split_gpu_type("v100"), None);
        assert_eq!(split_gpu_type("_1"), None);
        assert_eq!(gpu_type("v100", 2), "v100_2");
        assert_eq!(without_gate("matlab:2,multiplex:1"), "matlab:2");
        assert_eq!(without_gate("multiplex:1"), "");
    }
}
