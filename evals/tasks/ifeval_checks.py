"""ifeval_local's scoring: lm-eval's own IFEval checkers and aggregation, unchanged (lm_eval/tasks/ifeval/utils.py).

Importing it imports the checkers, which need `lm-eval[ifeval]` and nltk's punkt_tab data; sft_recipes.scores.tasks
refuses the task before this module is imported when they are missing.
"""

from lm_eval.tasks.ifeval.utils import agg_inst_level_acc, process_results

__all__ = ["agg_inst_level_acc", "process_results"]
